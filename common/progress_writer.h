// The one writer of progress records (proto/progress.proto): every JSON line rubato_worker and
// rubato_server write on stdout for ./rubato launch goes through here.
//
//   ProgressRecord r;
//   RejoinRecord* rejoin = r.mutable_rejoin();
//   rejoin->set_worker(1);
//   ...
//   WriteProgress(std::cout, r);  // {"event":"rejoin","worker":1,"step":7,...}\n, flushed
//
// A line is the record's message printed by protobuf's JSON printer with the proto field names
// (snake_case) and every field without presence (zeros too), "event" first, and 64-bit integers
// as numbers rather than strings; proto/progress.proto says why and how each kind prints.
#ifndef RUBATO_COMMON_PROGRESS_WRITER_H_
#define RUBATO_COMMON_PROGRESS_WRITER_H_

#include <ostream>
#include <string>

#include "proto/progress.pb.h"

namespace rubato {

// The record as one line of JSON, without the newline: {"event":"<kind>",<the kind's fields>}.
// A record with no kind set is {"event":""}.
std::string ProgressLine(const ProgressRecord& record);

// Writes ProgressLine(record) and '\n' to `out`, and flushes `out` unless `flush` is false (a
// record written every step, such as worker 0's noise record, then goes out with the next flushed
// one: a write and a wake-up of the reader per step cost the 2-core demo 20% of its wall time).
void WriteProgress(std::ostream& out, const ProgressRecord& record, bool flush = true);

// `value` rounded as printf's "%.<decimals>f" rounds it (RoundDecimals(3.14159, 3) == 3.142),
// or to `digits` significant digits as "%.<digits>g" does (RoundSignificant(123456789, 6) ==
// 123457000). The records keep the precision their figures mean something to; a value that is not
// finite is returned as it is.
double RoundDecimals(double value, int decimals);
double RoundSignificant(double value, int digits);

}  // namespace rubato

#endif  // RUBATO_COMMON_PROGRESS_WRITER_H_
