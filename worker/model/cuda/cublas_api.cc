// CublasApi: dlopen() of libcublas.so.13 and dlsym() of the entry points the backend uses.
#include "worker/model/cuda/cublas_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace rubato {
namespace {

constexpr char kLibrary[] = "libcublas.so.13";

// The candidates in the order CublasApi::Load documents.
std::vector<std::string> CandidatePaths() {
  std::vector<std::string> paths;
  if (const char* dir = std::getenv("RUBATO_CUBLAS_DIR"); dir != nullptr && *dir != '\0') {
    paths.push_back(absl::StrCat(dir, "/", kLibrary));
  }
  paths.push_back(kLibrary);
  if (const char* cuda = std::getenv("CUDA_PATH"); cuda != nullptr && *cuda != '\0') {
    paths.push_back(absl::StrCat(cuda, "/lib64/", kLibrary));
  }
  paths.push_back(absl::StrCat("/usr/local/cuda/lib64/", kLibrary));
  return paths;
}

// Looks up `name` in `library` into *fn; appends to *missing when absent.
template <typename Fn>
void Resolve(void* library, const char* name, Fn* fn, std::vector<std::string>* missing) {
  dlerror();
  *fn = reinterpret_cast<Fn>(dlsym(library, name));
  if (*fn == nullptr) {
    const char* error = dlerror();
    missing->push_back(absl::StrCat(name, " (", error != nullptr ? error : "null", ")"));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<CublasApi>> CublasApi::Load() {
  std::vector<std::string> tried;
  for (const std::string& path : CandidatePaths()) {
    void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) {
      const char* error = dlerror();
      tried.push_back(absl::StrCat(path, ": ", error != nullptr ? error : "unknown error"));
      continue;
    }
    std::unique_ptr<CublasApi> api(new CublasApi());
    api->library_ = library;
    api->path_ = path;
    std::vector<std::string> missing;
    Resolve(library, "cublasCreate_v2", &api->create, &missing);
    Resolve(library, "cublasDestroy_v2", &api->destroy, &missing);
    Resolve(library, "cublasSetStream_v2", &api->set_stream, &missing);
    Resolve(library, "cublasSetMathMode", &api->set_math_mode, &missing);
    Resolve(library, "cublasSgemm_v2", &api->sgemm, &missing);
    std::vector<std::string> optional;
    Resolve(library, "cublasGetStatusName", &api->get_status_name, &optional);
    if (!missing.empty()) {
      return absl::UnavailableError(
          absl::StrCat("cuBLAS at ", path, " lacks ", absl::StrJoin(missing, ", ")));
    }
    return api;
  }
  return absl::UnavailableError(
      absl::StrCat("cannot load cuBLAS; tried ", absl::StrJoin(tried, "; ")));
}

CublasApi::~CublasApi() {
  if (library_ != nullptr) dlclose(library_);
}

std::string CublasApi::StatusName(cublasStatus_t s) const {
  if (get_status_name != nullptr) {
    if (const char* name = get_status_name(s); name != nullptr) return name;
  }
  return absl::StrCat("cublasStatus ", static_cast<int>(s));
}

absl::Status CublasApi::Check(cublasStatus_t s, const char* what) const {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", StatusName(s)));
}

absl::StatusOr<CublasHandle> CublasHandle::Create(const CublasApi* api, cudaStream_t stream) {
  CublasHandle h;
  h.api_ = api;
  if (absl::Status s = api->Check(api->create(&h.handle_), "cublasCreate"); !s.ok()) {
    h.handle_ = nullptr;
    return s;
  }
  if (absl::Status s = api->Check(api->set_stream(h.handle_, stream), "cublasSetStream"); !s.ok()) {
    return s;
  }
  if (absl::Status s =
          api->Check(api->set_math_mode(h.handle_, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
      !s.ok()) {
    return s;
  }
  return h;
}

CublasHandle& CublasHandle::operator=(CublasHandle&& o) noexcept {
  if (this != &o) {
    Reset();
    api_ = o.api_;
    handle_ = o.handle_;
    o.handle_ = nullptr;
  }
  return *this;
}

void CublasHandle::Reset() {
  if (handle_ != nullptr) api_->destroy(handle_);
  handle_ = nullptr;
}

absl::Status CublasHandle::RowMajorGemm(bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                                        int64_t k, const float* a, const float* b, float* c,
                                        const char* what) const {
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (m > kMax || n > kMax || k > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": GEMM of ", m, "x", n, "x", k, " exceeds cuBLAS's 32-bit dimensions"));
  }
  // A row-major (r, c) matrix is the column-major (c, r) one with leading dimension c, so
  // row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: B comes first, and each
  // operand is transposed in cuBLAS's terms exactly when it is in ours.
  const float alpha = 1.0f, beta = 0.0f;
  const int lda = static_cast<int>(transpose_a ? m : k);
  const int ldb = static_cast<int>(transpose_b ? k : n);
  return api_->Check(
      api_->sgemm(handle_, transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                  transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
                  static_cast<int>(k), &alpha, b, ldb, a, lda, &beta, c, static_cast<int>(n)),
      what);
}

}  // namespace rubato
