// The example model: parameters, initialization, and one micro-batch through
// the Engine's hooks. See model.h.
#include "examples/train/model.h"

#include <algorithm>
#include <cmath>
#include <string_view>

namespace strata::example {
namespace {

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t HashName(std::string_view name) {
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a
  for (char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  return h;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

int64_t ModelShape::num_parameters() const {
  // ParameterList's sizes: 3 embedding tables and the head [V x H] + head.b
  // [V]; per block w1 [F x H], b1 [F], w2 [H x F], b2 [H].
  const int64_t V = vocab, H = hidden, F = ffn();
  return 4 * V * H + V + layers * (2 * F * H + F + H);
}

StatusOr<ModelShape> ShapeFromConfig(const Config& config) {
  STRATA_ASSIGN_OR_RETURN(const ModelConfig m, ModelConfigFromConfig(config));
  ModelShape s;
  s.layers = m.layers;
  s.hidden = m.hidden;
  s.seq_len = m.seq_len;
  s.vocab = m.vocab;
  s.batch = config.train_micro_batch_size_per_gpu;
  // The lower bounds are ValidateModelConfig's; these keep the sizes sane.
  if (s.layers > kMaxModelLayers || s.hidden > (1 << 20) || s.seq_len > (1 << 20) || s.batch < 1 ||
      s.batch > (1 << 20))
    return InvalidArgumentError("strata.model: layers " + std::to_string(s.layers) + ", hidden " +
                                std::to_string(s.hidden) + ", seq_len " +
                                std::to_string(s.seq_len) + ", micro-batch " +
                                std::to_string(s.batch) + " out of range");
  // Every GEMM dimension must fit BLAS's int.
  if (s.tokens() * s.ffn() > (int64_t{1} << 31) - 1)
    return InvalidArgumentError(
        "strata.model: micro-batch tokens × 4·hidden = " + std::to_string(s.tokens() * s.ffn()) +
        " elements exceeds 2^31 - 1");
  return s;
}

DType ParamDTypeFromConfig(const Config& config) {
  if (config.fp16.enabled) return DType::kFp16;
  if (config.bf16_enabled) return DType::kBf16;
  return DType::kFp32;
}

std::vector<ParamInfo> ParameterList(const ModelShape& s) {
  const int64_t V = s.vocab, H = s.hidden, F = s.ffn();
  std::vector<ParamInfo> out = {
      {"embed.tok", V * H, 0}, {"embed.prev1", V * H, 0}, {"embed.prev2", V * H, 0}};
  for (int64_t i = 1; i <= s.layers; ++i) {
    const std::string b = "block" + std::to_string(i);
    const int m = static_cast<int>(i);
    out.push_back({b + ".w1", F * H, m});
    out.push_back({b + ".b1", F, m});
    out.push_back({b + ".w2", H * F, m});
    out.push_back({b + ".b2", H, m});
  }
  const int head = static_cast<int>(s.layers) + 1;
  out.push_back({"head.w", V * H, head});
  out.push_back({"head.b", V, head});
  return out;
}

void InitParameter(const std::string& name, const ModelShape& s, uint64_t seed,
                   std::span<float> out) {
  // Uniform(−a, a) has standard deviation a / sqrt(3).
  double a = 0;
  if (name.rfind("embed.", 0) == 0) {
    a = 1.0;  // rms-normalized before use: the scale only sets the init's relative size
  } else if (EndsWith(name, ".w1") || name == "head.w") {
    a = std::sqrt(3.0 / static_cast<double>(s.hidden));
  } else if (EndsWith(name, ".w2")) {
    a = std::sqrt(3.0 / static_cast<double>(s.ffn())) /
        std::sqrt(2.0 * static_cast<double>(s.layers));
  }  // biases start at zero
  uint64_t st = seed ^ HashName(name);
  for (float& v : out) {
    const double u = static_cast<double>(SplitMix(&st) >> 11) * 0x1.0p-53;  // [0, 1)
    v = static_cast<float>((2.0 * u - 1.0) * a);
  }
}

Model::~Model() {
  for (void* p : workspaces_) engine_->FreeWorkspace(p).IgnoreError();
}

BackendLayout BackendWorkspaceLayout(const ModelShape& s) {
  const int64_t N = s.tokens(), H = s.hidden, F = s.ffn(), V = s.vocab;
  BackendLayout l{};
  int64_t at = 0;
  auto slot = [&at](int64_t bytes) {
    const int64_t offset = at;
    at += (bytes + 255) / 256 * 256;
    return offset;
  };
  l.a = slot(N * F * 4);
  l.g = slot(N * F * 4);
  l.u = slot(N * H * 4);
  l.du = slot(N * H * 4);
  l.z = slot(N * V * 4);
  l.rms = slot(N * 4);
  l.loss = slot(N * 4);
  l.dht = slot(N * H * 4);
  l.zt = slot(N * V * 4);
  l.partial = slot(kBackendColumnChunks * std::max(F, V) * 4);
  l.tokens = slot((3 * N + V + 1) * 4);
  l.total = at;
  return l;
}

int64_t BackendWorkspaceBytes(const ModelShape& s) { return BackendWorkspaceLayout(s).total; }

StatusOr<std::unique_ptr<Model>> Model::Create(Engine* engine, const ModelShape& shape, DType dtype,
                                               uint64_t seed) {
  if (engine == nullptr) return InvalidArgumentError("Model::Create: no engine");
  std::unique_ptr<Model> m(new Model(engine, shape, dtype));
  for (const ParamInfo& p : ParameterList(shape)) {
    ParamSpec spec;
    spec.name = p.name;
    spec.numel = p.numel;
    spec.dtype = dtype;
    spec.module = p.module;
    spec.initializer = [name = p.name, shape, seed](std::span<float> out) {
      InitParameter(name, shape, seed, out);
    };
    STRATA_ASSIGN_OR_RETURN(int id, engine->RegisterParameter(spec));
    (void)id;
  }
  STRATA_RETURN_IF_ERROR(engine->Plan());

  // Activations: the residual stream after every module but the head, and its gradient.
  const int64_t N = shape.tokens(), H = shape.hidden;
  WorkspaceFn alloc = [raw = m.get()](int64_t bytes) -> StatusOr<void*> {
    StatusOr<void*> p = raw->engine_->AllocateWorkspace(bytes);
    if (!p.ok())
      return Status(p.status())
          .WithContext("activations of the example model (" + std::to_string(bytes) +
                       " bytes more; " + std::to_string(raw->workspace_bytes_) +
                       " bytes already allocated)");
    raw->workspaces_.push_back(*p);
    raw->workspace_bytes_ += bytes;
    return *p;
  };
  STRATA_ASSIGN_OR_RETURN(void* stream_buf, alloc((shape.layers + 2) * N * H * 4));
  float* f = static_cast<float*>(stream_buf);
  for (int64_t i = 0; i <= shape.layers; ++i) m->hs_.push_back(f + i * N * H);
  m->dh_ = f + (shape.layers + 1) * N * H;

  if (engine->DeviceIsHost()) {
    STRATA_RETURN_IF_ERROR(CheckHostBackendMemory(shape));
    m->backend_ = NewHostBackend(shape, dtype, alloc);
  } else {
    STRATA_ASSIGN_OR_RETURN(m->backend_,
                            NewCudaBackend(shape, dtype, engine->ComputeStream(), alloc));
  }
  STRATA_RETURN_IF_ERROR(m->backend_->Prepare());
  return m;
}

StatusOr<double> Model::MicroBatch(std::span<const int32_t> inputs,
                                   std::span<const int32_t> targets) {
  STRATA_RETURN_IF_ERROR(backend_->SetBatch(inputs, targets));
  const int L = static_cast<int>(shape_.layers);
  const int head = L + 1;
  // Forward.
  {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeForward(0));
    STRATA_RETURN_IF_ERROR(backend_->EmbedForward(v.params, hs_[0]));
    STRATA_RETURN_IF_ERROR(engine_->AfterForward(0));
  }
  for (int i = 1; i <= L; ++i) {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeForward(i));
    STRATA_RETURN_IF_ERROR(backend_->BlockForward(v.params, hs_[i - 1], hs_[i]));
    STRATA_RETURN_IF_ERROR(engine_->AfterForward(i));
  }
  {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeForward(head));
    // Each micro-batch's gradients are summed over the window (no 1 /
    // accumulation); under data parallelism the engine averages the ranks',
    // so each rank scales its own by the ranks: the sum of the global batch,
    // as one rank accumulating every micro-batch.
    STRATA_RETURN_IF_ERROR(backend_->HeadForwardAsync(
        v.params, hs_[L], engine_->loss_scale() * static_cast<double>(engine_->world_size())));
    STRATA_RETURN_IF_ERROR(engine_->AfterForward(head));
  }
  // Backward, in reverse module order.
  {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeBackward(head));
    STRATA_RETURN_IF_ERROR(backend_->HeadBackward(v.params, v.grads, hs_[L], dh_));
    STRATA_RETURN_IF_ERROR(engine_->AfterBackward(head));
  }
  for (int i = L; i >= 1; --i) {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeBackward(i));
    STRATA_RETURN_IF_ERROR(backend_->BlockBackward(v.params, v.grads, hs_[i - 1], dh_));
    STRATA_RETURN_IF_ERROR(engine_->AfterBackward(i));
  }
  {
    STRATA_ASSIGN_OR_RETURN(ModuleView v, engine_->BeforeBackward(0));
    STRATA_RETURN_IF_ERROR(backend_->EmbedBackward(v.grads, dh_));
    STRATA_RETURN_IF_ERROR(engine_->AfterBackward(0));
  }
  // The loss, read once the whole micro-batch is enqueued.
  return backend_->Loss();
}

}  // namespace strata::example
