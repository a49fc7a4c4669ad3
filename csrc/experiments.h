// EXPERIMENTS (performance A/B, to be removed once measured): code paths that
// one build carries side by side so that a single GPU session can time them.
// Each experiment is an integer variant; 0 is the production path. A variant
// comes from its environment variable, read once on the host at first use,
// and can be changed later by set_experiment (the hidden _C._set_variant),
// so one process can switch between them. Every variant of an experiment
// must meet the op's contract; the choice only moves time.
#pragma once

#include <string>

namespace aamp {

enum class Experiment : int {
  kStats = 0,  // AAMP_STATS_VARIANT: tensor_stats main loop (stats_cuda.cu)
  kCount
};

// The variant in force (environment at first use, or the last set_experiment).
int experiment(Experiment e);

// Sets an experiment's variant by its name ("stats" or the environment
// variable's name); ArgumentError on an unknown name or variant.
void set_experiment(const std::string& name, int value);

}  // namespace aamp
