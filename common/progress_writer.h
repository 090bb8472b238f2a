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

#include <fstream>
#include <memory>
#include <ostream>
#include <streambuf>
#include <string>

#include "absl/status/statusor.h"
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

// Makes the directory that will hold `path` (and its parents) if missing, so that an output can
// go to a fresh per-run directory on a shared volume. InvalidArgument naming it when it cannot.
absl::Status MakeParentDirectory(const std::string& path);

// While it lives, everything written to `stream` (std::cout: the progress records) is also
// appended to a file, so that the records outlive a container's log (Kubernetes deletes it with
// the pod). Appends: a process started again after a failure adds its records to its earlier
// ones. Its directory is made if missing. A write to the file that fails does not stop the stream; the destructor logs it.
//
//   auto copy = CopyStreamTo::Open(&std::cout, "/opt/rubato/outputs/worker-0.jsonl");
class CopyStreamTo {
 public:
  // InvalidArgument naming the path when the file cannot be opened for appending.
  static absl::StatusOr<std::unique_ptr<CopyStreamTo>> Open(std::ostream* stream,
                                                            const std::string& path);
  ~CopyStreamTo();  // Flushes the file and gives `stream` its own buffer back.
  CopyStreamTo(const CopyStreamTo&) = delete;
  CopyStreamTo& operator=(const CopyStreamTo&) = delete;

 private:
  class Tee : public std::streambuf {
   public:
    Tee(std::streambuf* first, std::streambuf* second) : first_(first), second_(second) {}

   protected:
    int overflow(int c) override;
    std::streamsize xsputn(const char* s, std::streamsize n) override;
    int sync() override;

   private:
    std::streambuf* const first_;
    std::streambuf* const second_;
  };
  CopyStreamTo(std::ostream* stream, std::string path) : stream_(stream), path_(std::move(path)) {}

  std::ostream* const stream_;
  const std::string path_;
  std::ofstream file_;
  std::unique_ptr<Tee> tee_;
  std::streambuf* original_ = nullptr;
};

}  // namespace rubato

#endif  // RUBATO_COMMON_PROGRESS_WRITER_H_
