#pragma once
// The SIMD instruction set the engine's kernels run on. Every kernel gives the same bits on each
// of them (kernels/ documents how), so the choice changes speed only. It can be forced, so one
// machine tests and measures every target it supports: `MOE_SIMD=avx2` in the environment, or
// the `--simd` option of `moe`, or simd::select.
#include <string>
#include <string_view>
#include <vector>

namespace moe::simd {

enum class Target { Auto, Avx512, Avx2, Scalar };

// "auto", "avx512", "avx2" or "scalar"; anything else is an error naming `what` (the option or
// variable it came from) and the accepted values.
Target parse(std::string_view name, std::string_view what);
// Short name as accepted by parse ("avx512", ...).
const char* name(Target t);
// Human-readable name with the instruction set, e.g. "AVX-512 (F/BW/DQ/VL)".
const char* description(Target t);

// The targets this CPU runs, best first (scalar always included).
std::vector<Target> supported();
// Their names, e.g. "avx512, avx2, scalar".
std::string supported_names();
// Makes every later kernel call run on `t` (Auto: the best supported). An unsupported target is
// an error naming the CPU's supported ones. Call before parallel work starts.
void select(Target t);
// The target kernels run on now. The first call applies MOE_SIMD from the environment.
Target current();
// A --simd option's value: empty keeps MOE_SIMD or auto (and reports a bad MOE_SIMD now),
// anything else is parsed (errors name `what`) and selected.
void apply_option(const std::string& value, std::string_view what);

// The CPU model from /proc/cpuinfo (or "unknown CPU"), for reports.
std::string cpu_model();

}  // namespace moe::simd

// HWY_DYNAMIC_DISPATCH after applying the forced target (MOE_SIMD) on first use: every kernel
// entry point dispatches through this.
#define MOE_DISPATCH(fn) (::moe::simd::current(), HWY_DYNAMIC_DISPATCH(fn))
