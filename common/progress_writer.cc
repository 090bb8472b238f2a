#include "common/progress_writer.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/log.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/type_resolver.h"
#include "google/protobuf/util/type_resolver_util.h"

namespace rubato {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

// Rewrites the JSON protobuf's printer wrote for a message, copying it token by token and
// unquoting the values of 64-bit integer fields ("step":"200" -> "step":200), which the
// descriptors tell apart from strings that hold digits. The input is the printer's compact output;
// anything else makes Rewrite fail, and the caller keeps the printer's JSON as it is.
class Int64Unquoter {
 public:
  explicit Int64Unquoter(absl::string_view json) : in_(json) {}

  // The rewritten JSON of an object of type `message`, or false.
  bool Rewrite(const Descriptor* message, std::string* out) {
    out_.clear();
    pos_ = 0;
    if (!Object(message) || pos_ != in_.size()) return false;
    *out = std::move(out_);
    return true;
  }

 private:
  // An object whose keys are the fields of `message` (null: unknown, copied as they are).
  bool Object(const Descriptor* message) {
    if (!Take('{')) return false;
    if (Take('}')) return true;
    do {
      absl::string_view key;
      if (!String(&key) || !Take(':')) return false;
      // The printer writes the proto names (preserve_proto_field_names).
      const FieldDescriptor* field =
          message == nullptr ? nullptr : message->FindFieldByName(std::string(key));
      if (!Value(field, /*element=*/false)) return false;
    } while (Take(','));
    return Take('}');
  }

  // The value of `field` (null: copied as it is); `element`: one element of a repeated field.
  bool Value(const FieldDescriptor* field, bool element) {
    if (field == nullptr) return Copy();
    if (field->is_map() && !element) {
      // {"key":value,...}: keys are strings whatever their type; values are the entry's "value".
      const FieldDescriptor* value = field->message_type()->map_value();
      if (!Take('{')) return false;
      if (Take('}')) return true;
      do {
        absl::string_view key;
        if (!String(&key) || !Take(':') || !Value(value, /*element=*/true)) return false;
      } while (Take(','));
      return Take('}');
    }
    if (field->is_repeated() && !element) {
      if (!Take('[')) return false;
      if (Take(']')) return true;
      do {
        if (!Value(field, /*element=*/true)) return false;
      } while (Take(','));
      return Take(']');
    }
    switch (field->cpp_type()) {
      case FieldDescriptor::CPPTYPE_MESSAGE:
        // The well-known types have JSON forms of their own (Timestamp, Struct, wrappers, ...).
        if (field->message_type()->file()->package() == "google.protobuf") return Copy();
        return Object(field->message_type());
      case FieldDescriptor::CPPTYPE_INT64:
      case FieldDescriptor::CPPTYPE_UINT64: {
        if (Peek() != '"') return Copy();
        const size_t at = out_.size();
        absl::string_view text;
        if (!String(&text)) return false;
        if (IsInteger(text)) out_.replace(at, std::string::npos, text.data(), text.size());
        return true;
      }
      default:
        return Copy();
    }
  }

  static bool IsInteger(absl::string_view text) {
    if (!text.empty() && text[0] == '-') text.remove_prefix(1);
    if (text.empty()) return false;
    for (char c : text) {
      if (c < '0' || c > '9') return false;
    }
    return true;
  }

  // Any value, copied as it is.
  bool Copy() {
    switch (Peek()) {
      case '"': {
        absl::string_view ignored;
        return String(&ignored);
      }
      case '{':
        return Object(nullptr);
      case '[':
        if (!Take('[')) return false;
        if (Take(']')) return true;
        do {
          if (!Copy()) return false;
        } while (Take(','));
        return Take(']');
      default: {
        // A number, true, false or null: up to the next delimiter.
        const size_t start = pos_;
        while (pos_ < in_.size() && in_[pos_] != ',' && in_[pos_] != '}' && in_[pos_] != ']') {
          ++pos_;
        }
        if (pos_ == start) return false;
        out_.append(in_.data() + start, pos_ - start);
        return true;
      }
    }
  }

  // A string, copied; `text` is what is between its quotes, escapes as they are.
  bool String(absl::string_view* text) {
    if (Peek() != '"') return false;
    const size_t start = pos_++;
    while (pos_ < in_.size() && in_[pos_] != '"') pos_ += in_[pos_] == '\\' ? 2 : 1;
    if (pos_ >= in_.size()) return false;
    ++pos_;
    *text = in_.substr(start + 1, pos_ - start - 2);
    out_.append(in_.data() + start, pos_ - start);
    return true;
  }

  char Peek() const { return pos_ < in_.size() ? in_[pos_] : '\0'; }

  // Copies `c` if it comes next.
  bool Take(char c) {
    if (Peek() != c) return false;
    ++pos_;
    out_.push_back(c);
    return true;
  }

  const absl::string_view in_;
  size_t pos_ = 0;
  std::string out_;
};

// protobuf's JSON of `message`: the proto field names, every field without presence (zeros too).
// As MessageToJsonString, through the binary form, but serialized deterministically, so that maps
// print in the order of their keys rather than in their hash table's.
absl::Status PrintJson(const google::protobuf::Message& message, std::string* json) {
  constexpr char kTypeUrlPrefix[] = "type.googleapis.com";
  static google::protobuf::util::TypeResolver* const resolver =
      google::protobuf::util::NewTypeResolverForDescriptorPool(
          kTypeUrlPrefix, google::protobuf::DescriptorPool::generated_pool());
  std::string binary;
  {
    google::protobuf::io::StringOutputStream stream(&binary);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!message.SerializeToCodedStream(&coded)) {
      return absl::InternalError("cannot serialize it");
    }
  }
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  const auto status = google::protobuf::util::BinaryToJsonString(
      resolver, absl::StrCat(kTypeUrlPrefix, "/", message.GetDescriptor()->full_name()), binary,
      json, options);
  if (!status.ok()) return absl::InternalError(status.ToString());
  return absl::OkStatus();
}

// A double as printf prints it with `format` ("%.3f", "%.6g"), read back.
double Reprinted(const char* format, int precision, double value) {
  if (!std::isfinite(value)) return value;
  char text[512];
  std::snprintf(text, sizeof(text), format, precision, value);
  return std::strtod(text, nullptr);
}

}  // namespace

std::string ProgressLine(const ProgressRecord& record) {
  const FieldDescriptor* kind =
      ProgressRecord::descriptor()->FindFieldByNumber(record.record_case());
  if (kind == nullptr) return "{\"event\":\"\"}";
  const google::protobuf::Message& body = record.GetReflection()->GetMessage(record, kind);
  std::string json;
  if (const absl::Status status = PrintJson(body, &json); !status.ok() || json.size() < 2) {
    // Not expected for the messages of proto/progress.proto; the line still names the kind.
    RUBATO_LOG(ERROR) << "cannot print the " << kind->name() << " record: " << status;
    json = "{}";
  }
  std::string unquoted;
  if (Int64Unquoter(json).Rewrite(body.GetDescriptor(), &unquoted)) json = std::move(unquoted);
  // {"event":"<kind>"} then the object's fields, if any.
  std::string line = absl::StrCat("{\"event\":\"", kind->name(), "\"");
  if (json.size() > 2) {
    absl::StrAppend(&line, ",", absl::string_view(json).substr(1));
  } else {
    line += "}";
  }
  return line;
}

void WriteProgress(std::ostream& out, const ProgressRecord& record, bool flush) {
  out << ProgressLine(record) << '\n';
  if (flush) out.flush();
}

absl::Status MakeParentDirectory(const std::string& path) {
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  if (parent.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(parent, error);
  if (error) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot make the directory ", parent.string(), ": ", error.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CopyStreamTo>> CopyStreamTo::Open(std::ostream* stream,
                                                                  const std::string& path) {
  if (absl::Status made = MakeParentDirectory(path); !made.ok()) return made;
  std::unique_ptr<CopyStreamTo> copy(new CopyStreamTo(stream, path));
  copy->file_.open(path, std::ios::out | std::ios::app | std::ios::binary);
  if (!copy->file_.is_open()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot open ", path, " to append the progress records to: ",
                     std::strerror(errno)));
  }
  stream->flush();
  copy->tee_ = std::make_unique<Tee>(stream->rdbuf(), copy->file_.rdbuf());
  copy->original_ = stream->rdbuf(copy->tee_.get());
  return copy;
}

CopyStreamTo::~CopyStreamTo() {
  if (tee_ == nullptr) return;  // Open failed: the stream was never touched.
  stream_->flush();
  stream_->rdbuf(original_);
  file_.flush();
  if (!file_.good()) RUBATO_LOG(ERROR) << "could not write every progress record to " << path_;
}

int CopyStreamTo::Tee::overflow(int c) {
  if (c == traits_type::eof()) return traits_type::not_eof(c);
  second_->sputc(static_cast<char>(c));
  return first_->sputc(static_cast<char>(c));
}

std::streamsize CopyStreamTo::Tee::xsputn(const char* s, std::streamsize n) {
  second_->sputn(s, n);
  return first_->sputn(s, n);
}

int CopyStreamTo::Tee::sync() {
  const int second = second_->pubsync();
  const int first = first_->pubsync();
  return first == 0 && second == 0 ? 0 : -1;
}

double RoundDecimals(double value, int decimals) { return Reprinted("%.*f", decimals, value); }

double RoundSignificant(double value, int digits) { return Reprinted("%.*g", digits, value); }

}  // namespace rubato
