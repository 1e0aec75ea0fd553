// "auto", the Hugging Face integration's placeholder, for the keys a frontend
// fills (AutoValues): gradient_clipping, optimizer.params.{lr, betas, eps,
// weight_decay}, scheduler.params.{warmup_min_lr, warmup_max_lr,
// warmup_num_steps, total_num_steps}, fp16.enabled, bf16.enabled and the
// three batch sizes. Each
// resolution is one notice naming the key, the value used and where it came
// from. Also the batch-size rule: any two of train, micro and accumulation
// derive the third.
//
// (In zero_optimization, its offload sections and aio, "auto" means "the
// default" for every key: Section's auto_is_default, section.cc.)
#include <fmt/format.h>

#include <type_traits>
#include <utility>

#include "src/config/config_internal.h"

namespace strata::config_internal {
namespace {

template <typename T>
Status ReadAutoKey(Section& s, std::string_view key, const std::optional<T>& supplied,
                   std::string_view fallback, T* out) {
  if (!s.IsAutoKey(key)) {
    if constexpr (std::is_same_v<T, bool>)
      return s.Bool(key, out, Auto::kAllowed);
    else if constexpr (std::is_same_v<T, int64_t>)
      return s.Int(key, out, Auto::kAllowed);
    else
      return s.Double(key, out, Auto::kAllowed);
  }
  s.Take(key);
  if (supplied) *out = *supplied;
  s.Notice(fmt::format("{}: \"auto\" resolved to {} ({})", s.PathOf(key), *out,
                       supplied ? "given by the frontend" : fallback));
  return Status::Ok();
}

// Batch sizes: train = micro × accumulation × ranks (DataParallelRanks).
// Any two derive the third; one alone sets the missing ones as DeepSpeed
// does (accumulation 1).
Status ResolveBatch(std::optional<int64_t> train, std::optional<int64_t> micro,
                    std::optional<int64_t> gas, Config* c) {
  const int64_t ranks = DataParallelRanks();
  if (train && *train > 0 && ranks > 1) {
    if (*train % ranks != 0)
      return InvalidArgumentError(fmt::format(
          "train_batch_size: {} is not a multiple of the {} data-parallel ranks (WORLD_SIZE)",
          *train, ranks));
    train = *train / ranks;  // one rank's share, from here on
  }
  const std::pair<const char*, const std::optional<int64_t>*> given[] = {
      {"train_batch_size", &train},
      {"train_micro_batch_size_per_gpu", &micro},
      {"gradient_accumulation_steps", &gas}};
  for (const auto& [name, v] : given)
    if (v->has_value() && **v <= 0)
      return InvalidArgumentError(fmt::format("{}: {} is not allowed; must be > 0", name, **v));
  auto product = [](int64_t a, int64_t b, int64_t* out) -> Status {
    if (__builtin_mul_overflow(a, b, out))
      return InvalidArgumentError(fmt::format(
          "train_micro_batch_size_per_gpu {} × gradient_accumulation_steps {} overflows", a, b));
    return Status::Ok();
  };
  if (train && micro && gas) {
    int64_t p = 0;
    RETURN_IF_ERROR(product(*micro, *gas, &p));
    if (p != *train)
      return InvalidArgumentError(
          fmt::format("train_batch_size: {} is not train_micro_batch_size_per_gpu {} × "
                      "gradient_accumulation_steps {} = {} on each of {} rank{} (train = micro × "
                      "accumulation × data-parallel ranks, WORLD_SIZE)",
                      *train * ranks, *micro, *gas, p, ranks, ranks == 1 ? "" : "s"));
  } else if (train && micro) {
    if (*train % *micro != 0)
      return InvalidArgumentError(
          fmt::format("train_batch_size: {} is not a multiple of train_micro_batch_size_per_gpu {}",
                      *train, *micro));
    gas = *train / *micro;
  } else if (train && gas) {
    if (*train % *gas != 0)
      return InvalidArgumentError(
          fmt::format("train_batch_size: {} is not a multiple of gradient_accumulation_steps {}",
                      *train, *gas));
    micro = *train / *gas;
  } else if (micro && gas) {
    int64_t p = 0;
    RETURN_IF_ERROR(product(*micro, *gas, &p));
    train = p;
  } else if (train) {
    micro = *train;
    gas = 1;
  } else if (micro) {
    train = *micro;
    gas = 1;
  } else if (gas) {
    micro = 1;
    train = *gas;
  } else {
    train = micro = gas = 1;
  }
  c->train_batch_size = *train * ranks;
  c->train_micro_batch_size_per_gpu = *micro;
  c->gradient_accumulation_steps = *gas;
  return Status::Ok();
}

}  // namespace

Status ReadAutoBool(Section& s, std::string_view key, const std::optional<bool>& supplied,
                    std::string_view fallback, bool* out) {
  return ReadAutoKey(s, key, supplied, fallback, out);
}

Status ReadAutoDouble(Section& s, std::string_view key, const std::optional<double>& supplied,
                      std::string_view fallback, double* out) {
  return ReadAutoKey(s, key, supplied, fallback, out);
}

Status ReadAutoInt(Section& s, std::string_view key, const std::optional<int64_t>& supplied,
                   std::string_view fallback, int64_t* out) {
  return ReadAutoKey(s, key, supplied, fallback, out);
}

void ResolveAutoBetas(Section& p, const AutoValues& autos, std::string_view fallback,
                      OptimizerConfig* o) {
  p.Take("betas");
  if (autos.beta1) o->beta1 = *autos.beta1;
  if (autos.beta2) o->beta2 = *autos.beta2;
  p.Notice(fmt::format("{}: \"auto\" resolved to [{}, {}] ({})", p.PathOf("betas"), o->beta1,
                       o->beta2, autos.beta1 || autos.beta2 ? "given by the frontend" : fallback));
}

Status ReadBatchSizes(Section& top, const AutoValues& autos, Config* c) {
  struct BatchKey {
    const char* key;
    const std::optional<int64_t>& supplied;
    std::optional<int64_t> value;
    bool is_auto;
  } batch[] = {{"train_batch_size", autos.train_batch_size, {}, false},
               {"train_micro_batch_size_per_gpu", autos.train_micro_batch_size_per_gpu, {}, false},
               {"gradient_accumulation_steps", autos.gradient_accumulation_steps, {}, false}};
  for (BatchKey& b : batch) {
    b.is_auto = top.IsAutoKey(b.key);
    const json* v = top.Take(b.key);
    if (b.is_auto) {
      b.value = b.supplied;
    } else if (v != nullptr && !v->is_null()) {
      int64_t n = 0;
      RETURN_IF_ERROR(ReadInt(*v, b.key, &n));
      b.value = n;
    }
  }
  RETURN_IF_ERROR(ResolveBatch(batch[0].value, batch[1].value, batch[2].value, c));
  const int64_t resolved[] = {c->train_batch_size, c->train_micro_batch_size_per_gpu,
                              c->gradient_accumulation_steps};
  for (size_t i = 0; i < std::size(batch); ++i) {
    if (!batch[i].is_auto) continue;
    const int64_t ranks = DataParallelRanks();
    top.Notice(fmt::format(
        "{}: \"auto\" resolved to {} ({})", batch[i].key, resolved[i],
        batch[i].supplied ? std::string("given by the frontend")
        : ranks == 1      ? std::string("no frontend value; derived on one rank as train = micro x "
                                             "accumulation, 1 where nothing says more")
                          : fmt::format("no frontend value; derived on {} ranks as train = micro x "
                                             "accumulation x ranks, 1 where nothing says more",
                                        ranks)));
  }
  return Status::Ok();
}

}  // namespace strata::config_internal
