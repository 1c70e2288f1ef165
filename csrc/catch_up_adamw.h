// One coordinate of zen_ext.optim.CatchUpAdamW's step (zen_ext/optim.py is the reference and the test
// oracle), shared by host and device code. Arithmetic in float whatever the parameter's dtype; the
// weight, first and second moment are rounded to their dtype where the torch path stores them (after
// the decay, after each moment's update, after the step), so bf16/fp16 round as that path does.
#pragma once
#include <cmath>
#include <cstdint>

#include "hashing.h"  // ZEN_HD

namespace zen_ext {
namespace optim {

struct CatchUpStep {
  float decay;         // 1 - lr * weight_decay
  float beta1, beta2;  // Adam's betas
  float sqrt_bc2;      // sqrt(1 - beta2^t), t the global step
  float step_scale;    // lr / (1 - beta1^t)
  float eps;
  bool catch_up;       // false: every gradient, zero or not, is one step's (AdamW)
};

// The step's constants from the op's arguments (host code; the CPU op and the CUDA op both call it).
inline CatchUpStep catch_up_step(double lr, double beta1, double beta2, double eps, double weight_decay,
                                 int64_t step, bool catch_up) {
  CatchUpStep c;
  c.decay = static_cast<float>(1.0 - lr * weight_decay);
  c.beta1 = static_cast<float>(beta1);
  c.beta2 = static_cast<float>(beta2);
  c.sqrt_bc2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step))));
  c.step_scale = static_cast<float>(lr / (1.0 - std::pow(beta1, static_cast<double>(step))));
  c.eps = static_cast<float>(eps);
  c.catch_up = catch_up;
  return c;
}

// Step 1: decay; every coordinate ages. Step 2: where the gradient is non-zero (or catch_up is off),
// fold k = age steps of mean g/k and mean square g²/k into the moments. Step 3: there, move k steps'
// worth and reset the age. A coordinate that waits keeps its moments and (decayed) weight.
template <typename T>
ZEN_HD void catch_up_adamw_element(T& p, const T g, T& m, T& v, float& age, const CatchUpStep& c) {
  const T decayed = static_cast<T>(static_cast<float>(p) * c.decay);
  const float k = age + 1.0f;
  const float gf = static_cast<float>(g);
  if (gf == 0.0f && c.catch_up) {
    p = decayed;
    age = k;
    return;
  }
  const float keep1 = powf(c.beta1, k), keep2 = powf(c.beta2, k);
  const float g_mean = gf / k;
  const T m_new = static_cast<T>(keep1 * static_cast<float>(m) + (1.0f - keep1) * g_mean);
  const T v_new = static_cast<T>(keep2 * static_cast<float>(v) + (1.0f - keep2) * (gf * g_mean));
  m = m_new;
  v = v_new;
  const float denom = sqrtf(static_cast<float>(v_new)) / c.sqrt_bc2 + c.eps;
  p = static_cast<T>(static_cast<float>(decayed) - c.step_scale * (k * static_cast<float>(m_new) / denom));
  age = 0.0f;
}

}  // namespace optim
}  // namespace zen_ext
