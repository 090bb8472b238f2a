// Why an address cannot be reached, told apart: a name that does not resolve, a refused
// connection, a timeout, no route. gRPC reports all of these as one UNAVAILABLE or
// DEADLINE_EXCEEDED, so when a connection fails Rubato looks for itself with a plain TCP connect
// and puts the answer in its error:
//
//   cannot reach parameter server shard 1 at ps-1:5000 within 30s: the host name 'ps-1' does not
//   resolve (Name or service not known)
//
// The probe sends nothing but a TCP handshake to the address being diagnosed, waits up to 300 ms
// to see whether the far end hangs up unasked (a proxy whose backend is gone), and closes it.
#ifndef RUBATO_COMMON_NET_DIAGNOSE_H_
#define RUBATO_COMMON_NET_DIAGNOSE_H_

#include <string>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace rubato {

enum class Reachability {
  kConnects,     // A TCP connection succeeds and stays open: the failure is above TCP.
  kHangsUp,      // A TCP connection succeeds and the far end closes it unasked: a proxy alone.
  kBadAddress,   // Not host:port.
  kNoSuchHost,   // The host name does not resolve.
  kRefused,      // Every address refused: the host is up, nothing listens on the port.
  kTimedOut,     // No answer within the timeout: host down, cable cut, packets dropped.
  kUnreachable,  // No route to the host or network.
  kOtherError,   // Another socket error (named in the detail).
};

struct EndpointDiagnosis {
  Reachability kind = Reachability::kOtherError;
  // A sentence fragment naming the address and the cause, e.g. "connection refused by
  // 10.0.0.2:5000 (the host is up; nothing listens on that port)".
  std::string detail;
};

// Splits "host:port" or "[v6]:port" (brackets removed) after stripping a gRPC URI scheme
// ("dns:///", "ipv4:", ...); false if malformed or the port is not 1..65535.
bool SplitHostPort(absl::string_view address, std::string* host, std::string* port);

// Resolves `address` ("host:port", "[v6]:port", optionally with gRPC's "dns:///" or "ipv4:"
// prefix) and tries a TCP connection to each of its addresses, within `timeout` in all.
EndpointDiagnosis DiagnoseEndpoint(absl::string_view address, absl::Duration timeout);

// Why this process cannot listen on `address` ("host:port", "[v6]:port", port 0 for any), found
// with a test bind of each of its addresses (nothing is sent): "" if one binds (the failure is
// elsewhere), else a sentence fragment naming the cause, one of "port 5000 is in use on this host
// (another process listens on it)", "10.7.0.1 is not an address of this host (...)", "port 80
// needs privileges ...", "the host name 'x' does not resolve (...)", "'x' is not host:port".
std::string DiagnoseListen(absl::string_view address);

}  // namespace rubato

#endif  // RUBATO_COMMON_NET_DIAGNOSE_H_
