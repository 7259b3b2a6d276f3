// The device side of the epilogue vocabulary: one functor per op of fxfuse/epilogue.py, and the op tables.
//
// Adding an op: write its functor here, beside a comment naming its Python reference, and add one row to the
// matching table at the end of this file. The interpreter (interpreter.cuh) and the host binder
// (gemm_epilogue.cpp) expand the tables; neither needs an edit.
//
// All arithmetic is fp32, whatever the storage dtype. Functors must propagate NaN exactly as the reference does
// (fminf/fmaxf drop NaN: clamps use minimum/maximum below).
#pragma once

#include <cuda_runtime.h>
#include <math.h>

#include <type_traits>

#ifndef __CUDACC__
// The host-only translation units (gemm_epilogue.cpp, epilogue_backward.cpp) read this file for the op tables
// and never call a functor: a declaration is all the host compiler needs of this device function.
float rsqrtf(float);
#endif

namespace fxfuse {

// Scalar attributes of one instruction, in the order of the reference's keyword-only parameters, encoded by
// program_binding.cuh::encode_attribute (numbers as float, None as NaN, True/False as 1/0, 'none'/'tanh' as 0/1).
struct Attrs {
  float a0, a1, a2;
};

// The activations' e^x and reciprocals: the hardware approximations with denormals flushed (ex2.approx.ftz, 1
// instruction after the scaling multiply; rcp.approx.ftz, 1), not __expf / __fdividef, which add 3 and 6
// instructions of denormal and range handling per call (ncu: 13 of the mish program's 70 instructions per element).
// A relative error of 2 + 1.16 |x| ulp for e^x and 1 ulp for the reciprocal, which sigmoid, silu and mish damp;
// a result that would be denormal (|x| beyond 87) becomes 0, an absolute error under 1e-36.
__device__ __forceinline__ float activation_exp(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

__device__ __forceinline__ float approximate_reciprocal(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float sigmoid_of(float x) { return approximate_reciprocal(1.0f + activation_exp(-x)); }

// min and max that return NaN when either operand is NaN, as torch's clamp, amin and amax do: one instruction on
// sm_80 and later, against a compare, a NaN test and a select.
__device__ __forceinline__ float minimum(float a, float b) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float maximum(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// Whether an op's functor calls libdevice's math functions (expf, erff, tanhf, log1pf, ...: tens of instructions
// each): it says so with `static constexpr bool calls_libm = true`. The fast row kernel is also built without those
// ops, for the programs that use none of them; their code slowed the other programs by up to 12% (dev/NOTES.md,
// variant 37).
template <class F, class = void>
struct CallsLibm : std::false_type {};
template <class F>
struct CallsLibm<F, std::void_t<decltype(F::calls_libm)>> : std::bool_constant<F::calls_libm> {};

// Whether a max or min reduction gives a row's gradient to the one element that torch.max / torch.min's indices
// name, the first extreme (or first NaN), rather than splitting it between tied extremes as amax / amin do: it
// says so with `static constexpr bool first_index_gradient = true`.
template <class F, class = void>
struct FirstIndexGradient : std::false_type {};
template <class F>
struct FirstIndexGradient<F, std::void_t<decltype(F::first_index_gradient)>>
    : std::bool_constant<F::first_index_gradient> {};

// Whether a binary op takes a number for one operand: all but those that say `takes_numbers = false`, whose
// torch functions take two tensors (torch.maximum).
template <class F, class = void>
struct TakesNumbers : std::true_type {};
template <class F>
struct TakesNumbers<F, std::void_t<decltype(F::takes_numbers)>> : std::bool_constant<F::takes_numbers> {};

// Whether a binary op that takes numbers takes one for its first operand too: all but those that say
// `takes_number_first = false`, whose torch functions take a number for the second only (torch.copysign's sign).
template <class F, class = void>
struct TakesNumberFirst : TakesNumbers<F> {};
template <class F>
struct TakesNumberFirst<F, std::void_t<decltype(F::takes_number_first)>>
    : std::bool_constant<F::takes_number_first> {};

// Whether a binary op's gradient is a select, as torch's maximum / minimum (masked_fill_ of the loser to 0): a partial
// of 0 then gives exactly 0, not grad * 0 (NaN for an infinite or NaN grad). It says so with
// `static constexpr bool selects_gradient = true`.
template <class F, class = void>
struct SelectsGradient : std::false_type {};
template <class F>
struct SelectsGradient<F, std::void_t<decltype(F::selects_gradient)>> : std::bool_constant<F::selects_gradient> {};

// Whether a binary op gives its operands' gradients from the output's (`F::gradients(a, b, grad, grad_a, grad_b)`)
// rather than partials to scale it by, where torch's formula selects on an operand's value, so that neither a 0
// partial nor a 0 operand is its stand-in (prelu's slope gets exactly 0 where x > 0, x * grad elsewhere). It says
// so with `static constexpr bool gives_gradients = true`.
template <class F, class = void>
struct GivesGradients : std::false_type {};
template <class F>
struct GivesGradients<F, std::void_t<decltype(F::gives_gradients)>> : std::bool_constant<F::gives_gradients> {};

// ================================================================ unary pointwise: y = F::apply(x, attrs)
// num_attrs: how many attributes follow the operand in the program text. F::backward(x, grad, attrs) is the
// input's gradient for the output's gradient `grad`, as torch's autograd formula for the reference computes it
// (a select where autograd selects, so that a NaN gradient stays where autograd keeps it).

// fxfuse/epilogue.py::neg
struct Neg {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return -x; }
  __device__ static float backward(float, float grad, const Attrs&) { return -grad; }
};

// fxfuse/epilogue.py::relu (NaN stays NaN, as clamp_min does)
struct Relu {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x < 0.0f ? 0.0f : x; }
  __device__ static float backward(float x, float grad, const Attrs&) { return x <= 0.0f ? 0.0f : grad; }
};

// fxfuse/epilogue.py::clamp (a0 = min, a1 = max; None is NaN: no bound)
struct Clamp {
  static constexpr int num_attrs = 2;
  __device__ static float low(const Attrs& a) { return isnan(a.a0) ? -INFINITY : a.a0; }  // once per instruction
  __device__ static float high(const Attrs& a) { return isnan(a.a1) ? INFINITY : a.a1; }
  __device__ static float apply(float x, const Attrs& a) {
    return minimum(maximum(x, low(a)), high(a));  // a NaN x stays NaN
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    const float lower = low(a), upper = high(a);
    return x >= lower && x <= upper ? grad : 0.0f;  // false for a NaN x, as torch's mask
  }
};

// fxfuse/epilogue.py::hardtanh (a0 = min_val, a1 = max_val): clamp's values, a gradient stopped on the bounds
struct Hardtanh {
  static constexpr int num_attrs = 2;
  __device__ static float apply(float x, const Attrs& a) { return minimum(maximum(x, a.a0), a.a1); }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    return x <= a.a0 || x >= a.a1 ? 0.0f : grad;  // a NaN x keeps its gradient, as torch's hardtanh_backward
  }
};

// fxfuse/epilogue.py::leaky_relu (a0 = negative_slope)
struct LeakyRelu {
  static constexpr int num_attrs = 1;
  __device__ static float apply(float x, const Attrs& a) { return x > 0.0f ? x : x * a.a0; }
  __device__ static float backward(float x, float grad, const Attrs& a) { return x > 0.0f ? grad : grad * a.a0; }
};

// fxfuse/epilogue.py::elu (a0 = alpha, a1 = scale, a2 = input_scale)
struct Elu {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 3;
  __device__ static float apply(float x, const Attrs& a) {
    return x > 0.0f ? x * a.a1 : expm1f(x * a.a2) * a.a0 * a.a1;
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    return x > 0.0f ? grad * a.a1 : grad * a.a2 * a.a0 * a.a1 * expf(x * a.a2);
  }
};

// fxfuse/epilogue.py::gelu (a0 = approximate: 0 'none', 1 'tanh')
struct Gelu {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 1;
  __device__ static float apply(float x, const Attrs& a) {
    if (a.a0 != 0.0f) {
      const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.0f + tanhf(inner));
    }
    return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f));
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    if (a.a0 != 0.0f) {
      const float t = tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x));
      const float inner_derivative = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
      return grad * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * inner_derivative);
    }
    const float cdf = 0.5f * (1.0f + erff(x * 0.7071067811865476f));
    const float pdf = expf(-0.5f * x * x) * 0.3989422804014327f;
    return grad * (cdf + x * pdf);
  }
};

// fxfuse/epilogue.py::silu
struct Silu {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x * sigmoid_of(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float s = sigmoid_of(x);
    return grad * s * (1.0f + x * (1.0f - s));
  }
};

// fxfuse/epilogue.py::mish: x * tanh(log1p(e^x)) = x * n / (n + 2) with n = e^x (e^x + 2); one exp, one divide.
struct Mish {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) {
    if (x > 20.0f) return x;  // tanh(softplus(x)) rounds to 1 in fp32; also keeps n finite
    const float e = activation_exp(x);
    const float n = e * (e + 2.0f);
    return x * (n * approximate_reciprocal(n + 2.0f));
  }
  // tanh(softplus(x)) + x * sigmoid(x) * (1 - tanh(softplus(x))^2), with the forward's n
  __device__ static float backward(float x, float grad, const Attrs&) {
    if (x > 20.0f) return grad;
    const float e = activation_exp(x);
    const float n = e * (e + 2.0f);
    const float t = n * approximate_reciprocal(n + 2.0f);
    return grad * (t + x * (e * approximate_reciprocal(1.0f + e)) * (1.0f - t * t));
  }
};

// fxfuse/epilogue.py::sigmoid
struct Sigmoid {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return sigmoid_of(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = sigmoid_of(x);
    return grad * (1.0f - y) * y;
  }
};

// fxfuse/epilogue.py::tanh
struct Tanh {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return tanhf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = tanhf(x);
    return grad * (1.0f - y * y);
  }
};

// fxfuse/epilogue.py::softplus (a0 = beta, a1 = threshold)
struct Softplus {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 2;
  __device__ static float apply(float x, const Attrs& a) {
    const float scaled = x * a.a0;
    return scaled > a.a1 ? x : log1pf(expf(scaled)) / a.a0;
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    const float scaled = x * a.a0;
    if (scaled > a.a1) return grad;
    const float z = expf(scaled);
    return grad * z / (z + 1.0f);
  }
};

// fxfuse/epilogue.py::hardswish
struct Hardswish {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) {
    return x * minimum(maximum(x + 3.0f, 0.0f), 6.0f) * (1.0f / 6.0f);
  }
  __device__ static float backward(float x, float grad, const Attrs&) {
    if (x <= -3.0f) return 0.0f;
    return x < 3.0f ? grad * (x / 3.0f + 0.5f) : grad;
  }
};

// fxfuse/epilogue.py::hardsigmoid
struct Hardsigmoid {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) {
    return minimum(maximum(x + 3.0f, 0.0f), 6.0f) * (1.0f / 6.0f);  // NaN stays NaN, as torch's
  }
  __device__ static float backward(float x, float grad, const Attrs&) {
    return x > -3.0f && x < 3.0f ? grad * (1.0f / 6.0f) : 0.0f;
  }
};

// fxfuse/epilogue.py::exp
struct Exp {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return expf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * expf(x); }
};

// fxfuse/epilogue.py::log
struct Log {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return logf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / x; }
};

// fxfuse/epilogue.py::rsqrt (rsqrt(-0) = -inf and rsqrt(x < 0) = NaN, as torch's)
struct Rsqrt {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return rsqrtf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = rsqrtf(x);
    return -0.5f * grad * (y * y * y);
  }
};

// fxfuse/epilogue.py::abs
struct Abs {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return fabsf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    return x > 0.0f ? grad : (x < 0.0f ? -grad : grad * 0.0f);
  }
};

// fxfuse/epilogue.py::pow (a0 = exponent; the exponents eager special-cases take its exact formulas)
struct Pow {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 1;
  __device__ static float apply(float x, const Attrs& a) {
    const float e = a.a0;
    if (e == 2.0f) return x * x;
    if (e == 3.0f) return x * x * x;
    if (e == 0.5f) return sqrtf(x);
    if (e == 1.0f) return x;
    if (e == -1.0f) return 1.0f / x;
    return powf(x, e);
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    const float e = a.a0;
    if (e == 0.0f) return 0.0f;
    if (e == 1.0f) return grad;
    if (e == 2.0f) return grad * 2.0f * x;
    if (e == 3.0f) return grad * 3.0f * x * x;
    return grad * e * powf(x, e - 1.0f);
  }
};

// fxfuse/epilogue.py::sqrt (backward: grad / (2 sqrt(x)), so -inf at -0 as torch's)
struct Sqrt {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return sqrtf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / (2.0f * sqrtf(x)); }
};

// fxfuse/epilogue.py::reciprocal (IEEE division, not the activations' approximate reciprocal)
struct Reciprocal {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return 1.0f / x; }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = 1.0f / x;
    return -grad * (y * y);
  }
};

// fxfuse/epilogue.py::erf
struct Erf {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return erff(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    return 1.1283791670955126f * expf(-(x * x)) * grad;  // 2 / sqrt(pi)
  }
};

// fxfuse/epilogue.py::log1p
struct Log1p {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return log1pf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / (x + 1.0f); }
};

// fxfuse/epilogue.py::expm1 (backward from the result, as torch's: grad (expm1(x) + 1))
struct Expm1 {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return expm1f(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * (expm1f(x) + 1.0f); }
};

// fxfuse/epilogue.py::detach (the value, and no gradient whatever the gradient is: not grad * 0)
struct Detach {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x; }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::sin
struct Sin {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return sinf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * cosf(x); }
};

// fxfuse/epilogue.py::cos
struct Cos {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return cosf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * -sinf(x); }
};

// fxfuse/epilogue.py::log_sigmoid: min(x, 0) - log1p(e^-|x|); the backward is torch's log_sigmoid_backward
struct LogSigmoid {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) {
    return (x < 0.0f ? x : 0.0f) - log1pf(expf(-fabsf(x)));  // a NaN x: NaN from the log1p term
  }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const bool negative = x < 0.0f;
    const float z = expf(-fabsf(x));
    return grad * ((negative ? 1.0f : 0.0f) - (negative ? 1.0f : -1.0f) * (z / (1.0f + z)));
  }
};

// fxfuse/epilogue.py::softsign: x / (|x| + 1); the backward as autograd's through that division and abs (NaN at
// infinite x, as there)
struct Softsign {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x / (fabsf(x) + 1.0f); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float d = fabsf(x) + 1.0f;
    const float sign = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
    return grad / d + (-grad * x / (d * d)) * sign;
  }
};

// fxfuse/epilogue.py::tanhshrink: x - tanh(x)
struct Tanhshrink {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x - tanhf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = tanhf(x);
    return grad - grad * (1.0f - y * y);
  }
};

// fxfuse/epilogue.py::threshold (a0 = threshold, a1 = value): x <= threshold gives value (a NaN x stays NaN)
struct Threshold {
  static constexpr int num_attrs = 2;
  __device__ static float apply(float x, const Attrs& a) { return x <= a.a0 ? a.a1 : x; }
  __device__ static float backward(float x, float grad, const Attrs& a) { return x <= a.a0 ? 0.0f : grad; }
};

// fxfuse/epilogue.py::hardshrink (a0 = lambd): 0 on [-lambd, lambd] (a NaN x stays NaN)
struct Hardshrink {
  static constexpr int num_attrs = 1;
  __device__ static bool zeroed(float x, float lambd) { return x >= -lambd && x <= lambd; }
  __device__ static float apply(float x, const Attrs& a) { return zeroed(x, a.a0) ? 0.0f : x; }
  __device__ static float backward(float x, float grad, const Attrs& a) { return zeroed(x, a.a0) ? 0.0f : grad; }
};

// fxfuse/epilogue.py::softshrink (a0 = lambd): x moved lambd towards 0, 0 on [-lambd, lambd] (x * 0: NaN stays)
struct Softshrink {
  static constexpr int num_attrs = 1;
  __device__ static float apply(float x, const Attrs& a) {
    return x > a.a0 ? x - a.a0 : (x < -a.a0 ? x + a.a0 : x * 0.0f);
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    return x >= -a.a0 && x <= a.a0 ? 0.0f : grad;
  }
};

// fxfuse/epilogue.py::exp2 (backward as torch's from its result: grad 2^x ln 2)
struct Exp2 {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return exp2f(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * exp2f(x) * 0.6931471805599453f; }
};

// fxfuse/epilogue.py::log2
struct Log2 {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return log2f(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / (x * 0.6931471805599453f); }
};

// fxfuse/epilogue.py::log10
struct Log10 {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return log10f(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / (x * 2.3025850929940456f); }
};

// fxfuse/epilogue.py::tan (backward as torch's from its result: grad (1 + tan(x)^2))
struct Tan {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return tanf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    const float y = tanf(x);
    return grad * (1.0f + y * y);
  }
};

// fxfuse/epilogue.py::atan
struct Atan {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return atanf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad / (x * x + 1.0f); }
};

// fxfuse/epilogue.py::sinh
struct Sinh {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return sinhf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * coshf(x); }
};

// fxfuse/epilogue.py::cosh
struct Cosh {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return coshf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * sinhf(x); }
};

// fxfuse/epilogue.py::asinh (backward: grad rsqrt(x^2 + 1), 0 where x^2 overflows, as torch's)
struct Asinh {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return asinhf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) { return grad * rsqrtf(x * x + 1.0f); }
};

// fxfuse/epilogue.py::erfc (backward: -2 / sqrt(pi) e^(-x^2) grad, in torch's order)
struct Erfc {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return erfcf(x); }
  __device__ static float backward(float x, float grad, const Attrs&) {
    return -1.1283791670955126f * expf(-(x * x)) * grad;
  }
};

// fxfuse/epilogue.py::sign: (0 < x) - (x < 0), as torch's kernel (0 for NaN and -0); no gradient: exactly 0
struct Sign {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::floor (the rounding ops' gradient is exactly 0, torch's zeros_like)
struct Floor {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return floorf(x); }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::ceil
struct Ceil {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return ceilf(x); }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::trunc
struct Trunc {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return truncf(x); }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::round (halves to even: rintf, torch's nearbyint)
struct Round {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return rintf(x); }
  __device__ static float backward(float, float, const Attrs&) { return 0.0f; }
};

// fxfuse/epilogue.py::frac: x - trunc(x), as torch's kernel (NaN for an infinity); the gradient passes
struct Frac {
  static constexpr int num_attrs = 0;
  __device__ static float apply(float x, const Attrs&) { return x - truncf(x); }
  __device__ static float backward(float, float grad, const Attrs&) { return grad; }
};

// fxfuse/epilogue.py::logit (a0 = eps; None (NaN) or negative: no clamp), as torch's logit and logit_backward
// kernels: outside [eps, 1 - eps] the gradient is 0, unclamped NaN outside [0, 1]
struct Logit {
  static constexpr bool calls_libm = true;
  static constexpr int num_attrs = 1;
  __device__ static float apply(float x, const Attrs& a) {
    const float low = a.a0, high = 1.0f - a.a0;
    const float z = a.a0 >= 0.0f ? (x < low ? low : (x > high ? high : x)) : x;  // a NaN x stays NaN
    return logf(z / (1.0f - z));
  }
  __device__ static float backward(float x, float grad, const Attrs& a) {
    if (a.a0 >= 0.0f) return x < a.a0 || x > 1.0f - a.a0 ? 0.0f : grad / (x * (1.0f - x));
    return x < 0.0f || x > 1.0f ? NAN : grad / (x * (1.0f - x));
  }
};

// ================================================================ binary pointwise: y = F::apply(a, b)
// F::partials(a, b, da, db): dy/da and dy/db, as torch's autograd formulas (or F::gradients: GivesGradients).

// fxfuse/epilogue.py::add
struct Add {
  __device__ static float apply(float a, float b) { return a + b; }
  __device__ static void partials(float, float, float& da, float& db) { da = 1.0f, db = 1.0f; }
};

// fxfuse/epilogue.py::sub
struct Sub {
  __device__ static float apply(float a, float b) { return a - b; }
  __device__ static void partials(float, float, float& da, float& db) { da = 1.0f, db = -1.0f; }
};

// fxfuse/epilogue.py::mul
struct Mul {
  __device__ static float apply(float a, float b) { return a * b; }
  __device__ static void partials(float a, float b, float& da, float& db) { da = b, db = a; }
};

// fxfuse/epilogue.py::div
struct Div {
  __device__ static float apply(float a, float b) { return a / b; }
  __device__ static void partials(float a, float b, float& da, float& db) { da = 1.0f / b, db = -a / (b * b); }
};

// fxfuse/epilogue.py::maximum (NaN wins, as torch's; a tie splits the gradient, a NaN gives it whole to both)
struct Maximum {
  static constexpr bool takes_numbers = false;
  static constexpr bool selects_gradient = true;
  __device__ static float apply(float a, float b) { return maximum(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    da = a < b ? 0.0f : (a == b ? 0.5f : 1.0f);
    db = a > b ? 0.0f : (a == b ? 0.5f : 1.0f);
  }
};

// fxfuse/epilogue.py::minimum (as Maximum)
struct Minimum {
  static constexpr bool takes_numbers = false;
  static constexpr bool selects_gradient = true;
  __device__ static float apply(float a, float b) { return minimum(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    da = a > b ? 0.0f : (a == b ? 0.5f : 1.0f);
    db = a < b ? 0.0f : (a == b ? 0.5f : 1.0f);
  }
};

// fxfuse/epilogue.py::fmax (the larger; NaN only where both are, as fmaxf and torch's kernel): the gradient to a where
// a >= b or b is NaN, else to b, as torch's masked_fill selects
struct Fmax {
  static constexpr bool takes_numbers = false;
  static constexpr bool selects_gradient = true;
  __device__ static float apply(float a, float b) { return fmaxf(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    const bool to_a = a >= b || isnan(b);
    da = to_a ? 1.0f : 0.0f;
    db = to_a ? 0.0f : 1.0f;
  }
};

// fxfuse/epilogue.py::fmin (as Fmax: to a where a <= b or b is NaN)
struct Fmin {
  static constexpr bool takes_numbers = false;
  static constexpr bool selects_gradient = true;
  __device__ static float apply(float a, float b) { return fminf(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    const bool to_a = a <= b || isnan(b);
    da = to_a ? 1.0f : 0.0f;
    db = to_a ? 0.0f : 1.0f;
  }
};

// fxfuse/epilogue.py::logaddexp, as torch's kernel: an infinity beside itself is itself, else
// max + log1p(e^-|a - b|) (NaN from |a - b|); the partials 1 / (1 + e^(b - a)) and 1 / (1 + e^(a - b)), as torch's
struct Logaddexp {
  static constexpr bool calls_libm = true;
  static constexpr bool takes_numbers = false;
  __device__ static float apply(float a, float b) {
    if (isinf(a) && a == b) return a;
    return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
  }
  __device__ static void partials(float a, float b, float& da, float& db) {
    da = 1.0f / (1.0f + expf(b - a));
    db = 1.0f / (1.0f + expf(a - b));
  }
};

// fxfuse/epilogue.py::logaddexp2 (as Logaddexp, in base 2: log1p(2^-|a - b|) / ln 2)
struct Logaddexp2 {
  static constexpr bool calls_libm = true;
  static constexpr bool takes_numbers = false;
  __device__ static float apply(float a, float b) {
    if (isinf(a) && a == b) return a;
    return fmaxf(a, b) + log1pf(exp2f(-fabsf(a - b))) * 1.4426950408889634f;
  }
  __device__ static void partials(float a, float b, float& da, float& db) {
    da = 1.0f / (1.0f + exp2f(b - a));
    db = 1.0f / (1.0f + exp2f(a - b));
  }
};

// fxfuse/epilogue.py::hypot (hypotf: inf for an infinite operand, even beside NaN); partials a / hypot and b / hypot
// (NaN where both are 0, as torch's grad * a / result)
struct Hypot {
  static constexpr bool calls_libm = true;
  static constexpr bool takes_numbers = false;
  __device__ static float apply(float a, float b) { return hypotf(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    const float h = hypotf(a, b);
    da = a / h;
    db = b / h;
  }
};

// fxfuse/epilogue.py::atan2 (a: y, b: x); partials as torch's atan2_backward: b / (a^2 + b^2) and -a / (a^2 + b^2),
// 0 where a^2 + b^2 is 0
struct Atan2 {
  static constexpr bool calls_libm = true;
  static constexpr bool takes_numbers = false;
  __device__ static float apply(float a, float b) { return atan2f(a, b); }
  __device__ static void partials(float a, float b, float& da, float& db) {
    const float squares = a * a + b * b;
    const float r = squares == 0.0f ? 0.0f : 1.0f / squares;
    da = b * r;
    db = -a * r;
  }
};

// fxfuse/epilogue.py::copysign (copysignf: a's magnitude with b's sign bit, -0's and NaN's too, as torch's kernel);
// a's gradient as torch's copysign_tensor_self_backward, grad copysign(a, b) / a with 0 where a is 0; b's exactly 0
struct Copysign {
  static constexpr bool takes_number_first = false;
  static constexpr bool gives_gradients = true;
  __device__ static float apply(float a, float b) { return copysignf(a, b); }
  __device__ static void gradients(float a, float b, float grad, float& grad_a, float& grad_b) {
    grad_a = grad * (a == 0.0f ? 0.0f : copysignf(a, b) / a);
    grad_b = 0.0f;
  }
};

// fxfuse/epilogue.py::prelu (b: the slope; a NaN x is not > 0, so it stays NaN, as in torch's kernel)
struct Prelu {
  static constexpr bool takes_numbers = false;
  static constexpr bool gives_gradients = true;
  __device__ static float apply(float x, float w) { return x > 0.0f ? x : w * x; }
  // torch's _prelu_kernel_backward
  __device__ static void gradients(float x, float w, float grad, float& grad_x, float& grad_w) {
    const bool positive = x > 0.0f;
    grad_x = positive ? grad : w * grad;
    grad_w = positive ? 0.0f : x * grad;
  }
};

// ================================================================ per-feature affine of live statistics

// fxfuse/epilogue.py::batch_norm (eval mode; a0 = eps)
struct BatchNorm {
  __device__ static float apply(float x, float mean, float var, float weight, float bias, const Attrs& a) {
    return (x - mean) * rsqrtf(var + a.a0) * weight + bias;
  }
};

// ================================================================ statistics over a row or a row group

// What the interpreter computes over the group before calling a norm's apply or a reduction's result:
// (s0, s1) per group.
enum class Statistic {
  MeanAndRstd,        // (mean, 1 / sqrt(biased variance + eps)), two-pass over the values held on chip
  RootMeanSquare,     // (unused, 1 / sqrt(mean(x^2) + eps))
  MaxAndLogSumExp,    // (m, log(sum(exp(x - m)))), m = the max (logsumexp's: 0 where the max is infinite)
  Sum,                // (sum, unused)
  Max,                // (max, unused), NaN propagates
  Min,                // (min, unused), NaN propagates
  CenteredSquares,    // (mean, sum((x - mean)^2)), two-pass over the values held on chip
  RootSumSquare,      // (sqrt(sum(x^2)), max(that, eps)): the 2-norm, and normalize's denominator
};

// How the host reads a norm's attributes (which become eps and the group count).
enum class NormAttrs { GroupsEps, Eps, EpsOrFloatEps, Dim, DimEps };

// ---------------------------------------------------------------- norms: y = F::apply(x, s0, s1, weight, bias)

// fxfuse/epilogue.py::group_norm (weight, bias per feature; groups of contiguous features)
struct GroupNorm {
  static constexpr Statistic statistic = Statistic::MeanAndRstd;
  static constexpr NormAttrs attrs = NormAttrs::GroupsEps;
  __device__ static float apply(float x, float mean, float rstd, float w, float b) { return (x - mean) * rstd * w + b; }
};

// fxfuse/epilogue.py::layer_norm (over the last dim)
struct LayerNorm {
  static constexpr Statistic statistic = Statistic::MeanAndRstd;
  static constexpr NormAttrs attrs = NormAttrs::Eps;
  __device__ static float apply(float x, float mean, float rstd, float w, float b) { return (x - mean) * rstd * w + b; }
};

// fxfuse/epilogue.py::rms_norm (eps None means float32's epsilon: F.rms_norm computes bf16 and fp16 in float)
struct RmsNorm {
  static constexpr Statistic statistic = Statistic::RootMeanSquare;
  static constexpr NormAttrs attrs = NormAttrs::EpsOrFloatEps;
  __device__ static float apply(float x, float, float rstd, float w, float) { return x * rstd * w; }
};

// fxfuse/epilogue.py::normalize (p = 2; the division as F.normalize's)
struct Normalize {
  static constexpr Statistic statistic = Statistic::RootSumSquare;
  static constexpr NormAttrs attrs = NormAttrs::DimEps;
  __device__ static float apply(float x, float, float denominator, float, float) { return x / denominator; }
};

// fxfuse/epilogue.py::softmax
struct Softmax {
  static constexpr Statistic statistic = Statistic::MaxAndLogSumExp;
  static constexpr NormAttrs attrs = NormAttrs::Dim;
  __device__ static float apply(float x, float m, float log_sum, float, float) { return expf(x - m - log_sum); }
};

// fxfuse/epilogue.py::log_softmax
struct LogSoftmax {
  static constexpr Statistic statistic = Statistic::MaxAndLogSumExp;
  static constexpr NormAttrs attrs = NormAttrs::Dim;
  __device__ static float apply(float x, float m, float log_sum, float, float) { return x - m - log_sum; }
};

// ---------------------------------------------------------------- row reductions: y = F::result(s0, s1, count, a)
// Attributes after dim and keepdim, if any (num_attrs past those two), arrive in a (a0 = var's correction).

// fxfuse/epilogue.py::sum
struct Sum {
  static constexpr Statistic statistic = Statistic::Sum;
  __device__ static float result(float sum, float, int, const Attrs&) { return sum; }
};

// fxfuse/epilogue.py::mean
struct Mean {
  static constexpr Statistic statistic = Statistic::Sum;
  __device__ static float result(float sum, float, int count, const Attrs&) { return sum / static_cast<float>(count); }
};

// fxfuse/epilogue.py::amax
struct Amax {
  static constexpr Statistic statistic = Statistic::Max;
  __device__ static float result(float m, float, int, const Attrs&) { return m; }
};

// fxfuse/epilogue.py::amin
struct Amin {
  static constexpr Statistic statistic = Statistic::Min;
  __device__ static float result(float m, float, int, const Attrs&) { return m; }
};

// fxfuse/epilogue.py::max_dim (amax's values; the gradient to one element, FirstIndexGradient)
struct MaxDim {
  static constexpr Statistic statistic = Statistic::Max;
  static constexpr bool first_index_gradient = true;
  __device__ static float result(float m, float, int, const Attrs&) { return m; }
};

// fxfuse/epilogue.py::min_dim
struct MinDim {
  static constexpr Statistic statistic = Statistic::Min;
  static constexpr bool first_index_gradient = true;
  __device__ static float result(float m, float, int, const Attrs&) { return m; }
};

// fxfuse/epilogue.py::logsumexp
struct Logsumexp {
  static constexpr Statistic statistic = Statistic::MaxAndLogSumExp;
  __device__ static float result(float m, float log_sum, int, const Attrs&) { return m + log_sum; }
};

// fxfuse/epilogue.py::var (a0 = correction): the squared deviations over max(0, count - correction), as torch's
struct Var {
  static constexpr Statistic statistic = Statistic::CenteredSquares;
  static constexpr int extra_attrs = 1;
  __device__ static float result(float, float squares, int count, const Attrs& a) {
    return squares / fmaxf(0.0f, static_cast<float>(count) - a.a0);
  }
};

// fxfuse/epilogue.py::std (a0 = correction)
struct Std {
  static constexpr Statistic statistic = Statistic::CenteredSquares;
  static constexpr int extra_attrs = 1;
  __device__ static float result(float mean, float squares, int count, const Attrs& a) {
    return sqrtf(Var::result(mean, squares, count, a));
  }
};

// fxfuse/epilogue.py::vector_norm (the 2-norm)
struct VectorNorm {
  static constexpr Statistic statistic = Statistic::RootSumSquare;
  __device__ static float result(float norm, float, int, const Attrs&) { return norm; }
};

// Attributes of a reduction after its dim and keepdim: `static constexpr int extra_attrs`, else none.
template <class F, class = void>
struct ReductionExtraAttrs : std::integral_constant<int, 0> {};
template <class F>
struct ReductionExtraAttrs<F, std::void_t<decltype(F::extra_attrs)>> : std::integral_constant<int, F::extra_attrs> {};

// ================================================================ the tables: X(python_name, Functor)

#define FXFUSE_UNARY_OPS(X)                                                                                            \
  X(neg, Neg) X(relu, Relu) X(clamp, Clamp) X(hardtanh, Hardtanh) X(leaky_relu, LeakyRelu) X(elu, Elu)                 \
  X(gelu, Gelu) X(silu, Silu) X(mish, Mish) X(sigmoid, Sigmoid) X(tanh, Tanh) X(softplus, Softplus)                    \
  X(hardswish, Hardswish) X(hardsigmoid, Hardsigmoid) X(exp, Exp) X(log, Log) X(rsqrt, Rsqrt) X(abs, Abs)              \
  X(pow, Pow) X(sqrt, Sqrt) X(reciprocal, Reciprocal) X(erf, Erf) X(log1p, Log1p) X(expm1, Expm1) X(sin, Sin)          \
  X(cos, Cos) X(log_sigmoid, LogSigmoid) X(softsign, Softsign) X(tanhshrink, Tanhshrink) X(threshold, Threshold)       \
  X(hardshrink, Hardshrink) X(softshrink, Softshrink) X(detach, Detach) X(exp2, Exp2) X(log2, Log2) X(log10, Log10)    \
  X(tan, Tan) X(atan, Atan) X(sinh, Sinh) X(cosh, Cosh) X(asinh, Asinh) X(erfc, Erfc) X(sign, Sign) X(floor, Floor)    \
  X(ceil, Ceil) X(trunc, Trunc) X(round, Round) X(frac, Frac) X(logit, Logit)

#define FXFUSE_BINARY_OPS(X)                                                                                         \
  X(add, Add) X(sub, Sub) X(mul, Mul) X(div, Div) X(maximum, Maximum) X(minimum, Minimum) X(prelu, Prelu)            \
  X(fmax, Fmax) X(fmin, Fmin) X(logaddexp, Logaddexp) X(logaddexp2, Logaddexp2) X(hypot, Hypot) X(atan2, Atan2)      \
  X(copysign, Copysign)

#define FXFUSE_FEATURE_AFFINE_OPS(X) X(batch_norm, BatchNorm)

#define FXFUSE_NORM_OPS(X)                                                                                   \
  X(group_norm, GroupNorm) X(layer_norm, LayerNorm) X(rms_norm, RmsNorm) X(softmax, Softmax)                 \
  X(log_softmax, LogSoftmax) X(normalize, Normalize)

#define FXFUSE_REDUCTION_OPS(X)                                                                              \
  X(sum, Sum) X(mean, Mean) X(amax, Amax) X(amin, Amin) X(max_dim, MaxDim) X(min_dim, MinDim)                \
  X(logsumexp, Logsumexp) X(var, Var) X(std, Std) X(vector_norm, VectorNorm)

}  // namespace fxfuse
