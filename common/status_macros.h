// RETURN_IF_ERROR and ASSIGN_OR_RETURN: Debian's Abseil (20220623) ships neither.
#ifndef RUBATO_COMMON_STATUS_MACROS_H_
#define RUBATO_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if it is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status rubato_status_ = (expr);          \
    if (!rubato_status_.ok()) return rubato_status_; \
  } while (0)

#define RUBATO_CONCAT_INNER_(a, b) a##b
#define RUBATO_CONCAT_(a, b) RUBATO_CONCAT_INNER_(a, b)

// `lhs` = value of `expr` (an absl::StatusOr<T>), or returns its status from the enclosing
// function.
#define ASSIGN_OR_RETURN(lhs, expr) \
  RUBATO_ASSIGN_OR_RETURN_IMPL_(RUBATO_CONCAT_(rubato_statusor_, __LINE__), lhs, expr)

#define RUBATO_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

#endif  // RUBATO_COMMON_STATUS_MACROS_H_
