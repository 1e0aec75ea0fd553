// Text from a small stochastic grammar: English-like sentences whose bytes a
// trigram model can learn (spelling within words, word order, punctuation).
// Deterministic in the seed: splitmix64, no std distributions.
#include <array>
#include <string_view>

#include "examples/train/model.h"

namespace strata::example {
namespace {

uint64_t SplitMix(uint64_t* s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <size_t N>
std::string_view Pick(const std::array<std::string_view, N>& words, uint64_t* s) {
  return words[SplitMix(s) % N];
}

constexpr std::array<std::string_view, 12> kNouns = {"cat",   "dog",    "bird",  "river", "house", "garden",
                                                     "child", "farmer", "stone", "ship",  "road",  "lamp"};
constexpr std::array<std::string_view, 10> kVerbs = {"sees",  "finds", "likes", "keeps", "moves",
                                                     "hears", "draws", "holds", "wants", "helps"};
constexpr std::array<std::string_view, 8> kAdjectives = {"old", "small", "green", "quiet",
                                                         "bright", "cold", "tall", "slow"};
constexpr std::array<std::string_view, 6> kPlaces = {"by the sea", "in the town", "under the tree",
                                                     "on the hill", "at night", "in the rain"};

void Sentence(uint64_t* s, std::string* out) {
  auto noun_phrase = [&] {
    *out += (SplitMix(s) & 1) ? "the " : "a ";
    if (SplitMix(s) % 3 == 0) {
      *out += Pick(kAdjectives, s);
      *out += ' ';
    }
    *out += Pick(kNouns, s);
  };
  const size_t start = out->size();
  noun_phrase();
  (*out)[start] = static_cast<char>((*out)[start] - 'a' + 'A');
  *out += ' ';
  *out += Pick(kVerbs, s);
  *out += ' ';
  noun_phrase();
  if (SplitMix(s) % 4 == 0) {
    *out += ' ';
    *out += Pick(kPlaces, s);
  }
  *out += (SplitMix(s) % 5 == 0) ? "!\n" : ". ";
}

}  // namespace

TextData::TextData(uint64_t seed, int64_t bytes) : seed_(seed) {
  uint64_t s = seed ^ 0x5EEDull;
  text_.reserve(static_cast<size_t>(bytes) + 128);
  while (static_cast<int64_t>(text_.size()) < bytes) Sentence(&s, &text_);
}

void TextData::Batch(int64_t index, int64_t batch, int64_t seq_len, std::vector<int32_t>* inputs,
                     std::vector<int32_t>* targets) const {
  inputs->resize(static_cast<size_t>(batch * seq_len));
  targets->resize(static_cast<size_t>(batch * seq_len));
  const uint64_t span = text_.size() - static_cast<uint64_t>(seq_len) - 1;
  uint64_t s = seed_ * 0x100000001B3ull + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull + 17;
  for (int64_t b = 0; b < batch; ++b) {
    const uint64_t off = SplitMix(&s) % span;
    for (int64_t t = 0; t < seq_len; ++t) {
      (*inputs)[b * seq_len + t] = static_cast<unsigned char>(text_[off + t]);
      (*targets)[b * seq_len + t] = static_cast<unsigned char>(text_[off + t + 1]);
    }
  }
}

}  // namespace strata::example
