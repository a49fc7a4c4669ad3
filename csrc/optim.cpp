// Validation and dispatch of the fused optimizer family; shared by CPU and CUDA.
#include "optim.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace aamp {

namespace {

bool is_param_dtype(DType t) { return t == DType::kFloat32 || t == DType::kBFloat16; }

void check_ref(const TensorRef& t, const std::string& name) {
  if (t.numel < 0) throw_argument(name, "has a negative element count");
  if (t.numel > 0 && t.data == nullptr) throw_argument(name, "is a null pointer");
  if (reinterpret_cast<std::uintptr_t>(t.data) % dtype_size(t.dtype) != 0) {
    throw_argument(name, "is not aligned to its element size");
  }
}

void check_list(const std::vector<TensorRef>& list, const OptimArgs& a, const char* name, bool same_dtype) {
  if (list.size() != a.params.size()) {
    throw_argument(name, "has " + std::to_string(list.size()) + " tensors; params has " +
                             std::to_string(a.params.size()));
  }
  for (std::size_t k = 0; k < list.size(); ++k) {
    const std::string item = item_name(name, k);
    const TensorRef& t = list[k];
    if (same_dtype ? t.dtype != a.params[k].dtype : !is_param_dtype(t.dtype)) {
      throw_dtype(item, std::string("has dtype ") + dtype_name(t.dtype) +
                            (same_dtype ? std::string("; expected ") + dtype_name(a.params[k].dtype) +
                                              ", the dtype of params[" + std::to_string(k) + "]"
                                        : std::string("; expected float32 or bfloat16")));
    }
    check_ref(t, item);
    if (t.numel != a.params[k].numel) {
      throw_argument(item, "has " + std::to_string(t.numel) + " elements; params[" + std::to_string(k) + "] has " +
                               std::to_string(a.params[k].numel));
    }
  }
}

void check_scalar_ptr(const void* p, const char* name, std::size_t align) {
  if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % align != 0) {
    throw_argument(name, "is not aligned to its element size");
  }
}

void check_hyper(double v, const char* name, double lo, double hi, bool hi_open) {
  if (!std::isfinite(v) || v < lo || (hi_open ? v >= hi : v > hi)) {
    throw_argument(name, "is " + std::to_string(v) + "; expected a finite value in [" + std::to_string(lo) + ", " +
                             std::to_string(hi) + (hi_open ? ")" : "]"));
  }
}

// Every byte written (params, moments) must belong to one tensor only, and
// no input the step reads (grads, steps, grad_scale, found_inf) may lie in it:
// otherwise the result would depend on the order in which elements are done.
struct Span {
  std::uintptr_t begin, end;
  std::string name;
  bool written;
};

void check_spans(std::vector<Span> spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& x, const Span& y) { return x.begin < y.begin; });
  // Carry the furthest-reaching written and read spans seen so far.
  const Span* reach_w = nullptr;
  const Span* reach_any = nullptr;
  for (const Span& s : spans) {
    if (s.written && reach_any != nullptr && s.begin < reach_any->end) {
      throw_argument(s.name, "shares memory with " + reach_any->name + "; pass separate tensors");
    }
    if (!s.written && reach_w != nullptr && s.begin < reach_w->end) {
      throw_argument(s.name, "shares memory with " + reach_w->name + ", which the step writes; pass separate tensors");
    }
    if (reach_any == nullptr || s.end > reach_any->end) reach_any = &s;
    if (s.written && (reach_w == nullptr || s.end > reach_w->end)) reach_w = &s;
  }
}

void add_spans(std::vector<Span>& spans, const std::vector<TensorRef>& list, const char* name, bool written) {
  for (std::size_t k = 0; k < list.size(); ++k) {
    const TensorRef& t = list[k];
    if (t.numel == 0) continue;
    const auto b = reinterpret_cast<std::uintptr_t>(t.data);
    spans.push_back({b, b + static_cast<std::uintptr_t>(t.numel) * dtype_size(t.dtype), item_name(name, k), written});
  }
}

}  // namespace

std::size_t optim_workspace_bytes(const std::vector<TensorRef>& params) {
  std::size_t chunks = 0;
  for (const TensorRef& t : params) {
    chunks += static_cast<std::size_t>((std::max<std::int64_t>(t.numel, 0) + kOptimSumsqChunk - 1) / kOptimSumsqChunk);
  }
  return chunks * sizeof(float);
}

OptimConsts optim_consts(const OptimArgs& a) {
  OptimConsts c;
  c.lr = static_cast<float>(a.lr);
  c.beta1 = static_cast<float>(a.beta1);
  c.beta2 = static_cast<float>(a.beta2);
  c.eps = static_cast<float>(a.eps);
  c.lr_wd = static_cast<float>(a.lr * a.weight_decay);
  c.omb1 = static_cast<float>(1.0 - a.beta1);
  c.omb2 = static_cast<float>(1.0 - a.beta2);
  c.momentum = static_cast<float>(a.momentum);
  c.omd = static_cast<float>(1.0 - a.dampening);
  c.weight_decay = static_cast<float>(a.weight_decay);
  c.beta1_d = a.beta1;
  c.beta2_d = a.beta2;
  return c;
}

void validate_optim(const OptimArgs& a) {
  const bool adam = a.kind == OptimKind::kAdamW;
  if (a.kind != OptimKind::kAdamW && a.kind != OptimKind::kSGD) throw_argument("kind", "is not AdamW or SGD");
  for (std::size_t k = 0; k < a.params.size(); ++k) {
    const std::string item = item_name("params", k);
    if (!is_param_dtype(a.params[k].dtype)) {
      throw_dtype(item, std::string("has dtype ") + dtype_name(a.params[k].dtype) + "; expected float32 or bfloat16");
    }
    check_ref(a.params[k], item);
  }
  check_list(a.grads, a, "grads", true);
  const bool has_buf = adam || a.momentum != 0.0;
  if (has_buf) {
    check_list(a.exp_avgs, a, adam ? "exp_avgs" : "momentum_buffers", false);
  } else if (!a.exp_avgs.empty()) {
    throw_argument("momentum_buffers", "are given but momentum is 0; pass none");
  }
  if (adam) {
    check_list(a.exp_avg_sqs, a, "exp_avg_sqs", false);
    // The kernels take one moment type per tensor: a mixed pair would be read and written with the wrong width.
    for (std::size_t k = 0; k < a.exp_avg_sqs.size(); ++k) {
      if (a.exp_avg_sqs[k].dtype != a.exp_avgs[k].dtype) {
        throw_dtype(item_name("exp_avg_sqs", k), std::string("has dtype ") + dtype_name(a.exp_avg_sqs[k].dtype) +
                                                     "; expected " + dtype_name(a.exp_avgs[k].dtype) +
                                                     ", the dtype of exp_avgs[" + std::to_string(k) + "]");
      }
    }
    if (a.steps.size() != a.params.size()) {
      throw_argument("steps", "has " + std::to_string(a.steps.size()) + " entries; params has " +
                                  std::to_string(a.params.size()));
    }
    for (std::size_t k = 0; k < a.steps.size(); ++k) {
      if (a.steps[k] == nullptr) throw_argument(item_name("steps", k), "is a null pointer");
      check_scalar_ptr(a.steps[k], item_name("steps", k).c_str(), alignof(float));
    }
    check_hyper(a.beta1, "betas[0]", 0.0, 1.0, true);
    check_hyper(a.beta2, "betas[1]", 0.0, 1.0, true);
    check_hyper(a.eps, "eps", 0.0, 1e30, false);
  } else {
    if (!a.exp_avg_sqs.empty() || !a.steps.empty()) throw_argument("exp_avg_sqs", "are given to SGD; pass none");
    if (has_buf && a.first.size() != a.params.size()) {
      throw_argument("first", "has " + std::to_string(a.first.size()) + " entries; params has " +
                                  std::to_string(a.params.size()));
    }
    check_hyper(a.momentum, "momentum", 0.0, 1e30, false);
    check_hyper(a.dampening, "dampening", -1e30, 1e30, false);
    if (a.nesterov && (a.momentum <= 0.0 || a.dampening != 0.0)) {
      throw_argument("nesterov", "needs a momentum and zero dampening");
    }
  }
  check_hyper(a.lr, "lr", 0.0, 1e30, false);
  check_hyper(a.weight_decay, "weight_decay", 0.0, 1e30, false);
  check_scalar_ptr(a.grad_scale, "grad_scale", alignof(float));
  check_scalar_ptr(a.found_inf, "found_inf", alignof(float));
  check_scalar_ptr(a.seed_offset, "generator", alignof(std::uint64_t));
  if (a.grad_sumsq != nullptr) {
    check_scalar_ptr(a.grad_sumsq, "grad_sumsq", alignof(float));
    if (a.grad_sumsq_count != a.params.size()) {
      throw_argument("grad_sumsq", "holds " + std::to_string(a.grad_sumsq_count) + " floats; params has " +
                                       std::to_string(a.params.size()) + " tensors (one float each)");
    }
    if (a.place.is_cuda()) {
      const std::size_t need = optim_workspace_bytes(a.params);
      if (need > 0 && (a.workspace == nullptr || a.workspace_bytes < need)) {
        throw_argument("workspace", "holds " + std::to_string(a.workspace_bytes) + " bytes; " +
                                        std::to_string(need) + " are needed (optim_workspace_bytes)");
      }
      check_scalar_ptr(a.workspace, "workspace", alignof(float));
    }
  }

  std::vector<Span> spans;
  add_spans(spans, a.params, "params", true);
  add_spans(spans, a.grads, "grads", false);
  add_spans(spans, a.exp_avgs, adam ? "exp_avgs" : "momentum_buffers", true);
  add_spans(spans, a.exp_avg_sqs, "exp_avg_sqs", true);
  for (std::size_t k = 0; k < a.steps.size(); ++k) {
    const auto b = reinterpret_cast<std::uintptr_t>(a.steps[k]);
    spans.push_back({b, b + sizeof(float), item_name("steps", k), false});
  }
  for (const auto& [p, name] : {std::pair<const void*, const char*>{a.grad_scale, "grad_scale"},
                                {a.found_inf, "found_inf"}}) {
    if (p == nullptr) continue;
    const auto b = reinterpret_cast<std::uintptr_t>(p);
    spans.push_back({b, b + sizeof(float), name, false});
  }
  if (a.grad_sumsq != nullptr && a.grad_sumsq_count > 0) {  // written: may share memory with nothing
    const auto b = reinterpret_cast<std::uintptr_t>(a.grad_sumsq);
    spans.push_back({b, b + a.grad_sumsq_count * sizeof(float), "grad_sumsq", true});
  }
  if (a.grad_sumsq != nullptr && a.place.is_cuda() && a.workspace_bytes > 0) {
    const auto b = reinterpret_cast<std::uintptr_t>(a.workspace);
    spans.push_back({b, b + a.workspace_bytes, "workspace", true});
  }
  check_spans(std::move(spans));

  if (a.place.is_cuda() && !cuda_built()) {
    throw CudaError(
        "params: CUDA tensors were given, but adaptive_amp was built without CUDA kernels "
        "(nvcc was not found when it was installed). Reinstall with nvcc on PATH or CUDA_HOME set.");
  }
}

void optim_step(const OptimArgs& a) {
  validate_optim(a);
#ifdef AAMP_WITH_CUDA
  if (a.place.is_cuda()) return optim_step_cuda(a);
#endif
  optim_step_cpu(a);
}

}  // namespace aamp
