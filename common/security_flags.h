// The security flags every Rubato binary takes: --auth_secret_file, --tls_cert, --tls_key,
// --tls_ca and --insecure (common/security.h says what each does).
#ifndef RUBATO_COMMON_SECURITY_FLAGS_H_
#define RUBATO_COMMON_SECURITY_FLAGS_H_

#include "common/security.h"

namespace rubato {

SecurityConfig SecurityConfigFromFlags();

}  // namespace rubato

#endif  // RUBATO_COMMON_SECURITY_FLAGS_H_
