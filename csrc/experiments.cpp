// EXPERIMENTS (to be removed once measured): see experiments.h.
#include "experiments.h"

#include <atomic>
#include <cstdlib>
#include <string>

#include "core.h"

namespace aamp {

namespace {

struct Info {
  const char* name;
  const char* env;
  int variants;  // 0 .. variants - 1
};

constexpr Info kInfo[] = {
    {"stats", "AAMP_STATS_VARIANT", 2},
};
static_assert(sizeof(kInfo) / sizeof(kInfo[0]) == static_cast<int>(Experiment::kCount), "one Info per experiment");

constexpr int kUnread = -1;
std::atomic<int> g_value[static_cast<int>(Experiment::kCount)] = {{kUnread}};

int checked(const Info& info, long v, const std::string& source) {
  if (v < 0 || v >= info.variants) {
    throw ArgumentError(source + ": variant " + std::to_string(v) + " of " + info.name + " is not in 0.." +
                        std::to_string(info.variants - 1));
  }
  return static_cast<int>(v);
}

}  // namespace

int experiment(Experiment e) {
  const int i = static_cast<int>(e);
  int v = g_value[i].load(std::memory_order_relaxed);
  if (v != kUnread) return v;
  const char* s = std::getenv(kInfo[i].env);
  v = 0;
  if (s != nullptr && *s != '\0') {
    char* end = nullptr;
    const long parsed = std::strtol(s, &end, 10);
    if (*end != '\0') throw ArgumentError(std::string(kInfo[i].env) + "=" + s + ": not an integer");
    v = checked(kInfo[i], parsed, kInfo[i].env);
  }
  g_value[i].store(v, std::memory_order_relaxed);
  return v;
}

void set_experiment(const std::string& name, int value) {
  for (int i = 0; i < static_cast<int>(Experiment::kCount); ++i) {
    if (name == kInfo[i].name || name == kInfo[i].env) {
      g_value[i].store(checked(kInfo[i], value, "_set_variant"), std::memory_order_relaxed);
      return;
    }
  }
  throw ArgumentError("_set_variant: unknown experiment '" + name + "' (stats)");
}

}  // namespace aamp
