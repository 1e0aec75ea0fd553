// Internal Status helpers: short propagation macros and errno conversion.
// Every module converts foreign errors in one place with these.
#pragma once

#include <cerrno>
#include <string_view>

#include "strata/status.h"

#define RETURN_IF_ERROR(expr) STRATA_RETURN_IF_ERROR(expr)
#define ASSIGN_OR_RETURN(lhs, expr) STRATA_ASSIGN_OR_RETURN(lhs, expr)

// Aborts with file:line and the status text when `expr` is not OK. Only for
// tests, benchmarks and broken invariants: never for what the world can do.
#define CHECK_OK(expr)                                                                     \
  do {                                                                                     \
    ::strata::Status strata_check_status_ = (expr);                                        \
    if (!strata_check_status_.ok())                                                        \
      ::strata::internal::DieOnBadStatus(__FILE__, __LINE__, #expr, strata_check_status_); \
  } while (0)

namespace strata {

// "<context>: <strerror> (errno N)" with a code chosen from the errno:
// ENOENT→NotFound, ENOSPC/EDQUOT/ENOMEM→ResourceExhausted, EAGAIN/EBUSY/EINTR→
// Unavailable, EINVAL→InvalidArgument, ENOSYS/EOPNOTSUPP→NotSupported,
// ECANCELED→Cancelled, anything else→IOError.
Status ErrnoError(std::string_view context, int err);

namespace internal {
[[noreturn]] void DieOnBadStatus(const char* file, int line, const char* expr, const Status& s);
}  // namespace internal

}  // namespace strata
