// What the packed matmul's tiles share across their sources (packed_linear.cpp calls them): the
// weights' pointers, the tile function's type, and each instruction-set variant's table of tiles.
// Each variant is compiled from a source of its own (packed_tiles_portable.cpp,
// packed_tiles_avx2.cpp, packed_tiles_avx512.cpp), so a build compiles them in parallel and none
// of them parses ATen's headers.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "packed_activations.h"

#if defined(__x86_64__) && (defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2))
#include <cpuid.h>
#include <immintrin.h>
#define VS_X86 1
#endif
// The VNNI variants are compiled under GCC's target pragmas (not clang's), and only where the CPU
// runs them (cpu_kernels.py passes VS_BUILD_*VNNI): each is a third of the build's time.
#if defined(VS_X86) && defined(__GNUC__) && !defined(__clang__) && defined(VS_BUILD_AVXVNNI)
#define VS_AVX2_VNNI 1
#endif
#if defined(VS_X86) && defined(__GNUC__) && !defined(__clang__) && defined(VS_BUILD_AVX512VNNI)
#define VS_AVX512_VNNI 1
#endif

namespace vs {

constexpr int kMaxRows = 8;     // rows per register tile

struct Packed {
  const uint8_t* codes;  // [blocks, groups, bytes]
  const uint16_t* d;     // [blocks, groups, 16] fp16 bits
  const uint16_t* m;     // Q4_1's offsets, same shape; else null
};

using TileFn = void (*)(const Packed&, int64_t, const Act&, int64_t, float*);
struct TileTable {
  std::array<std::array<TileFn, kMaxRows>, kFormats> fn;  // [format][rows - 1]
  int rows;
};


// Each variant's tiles, [format][rows - 1].
const TileTable& portable_table();
#if defined(VS_X86)
const TileTable& avx2_table();
#if defined(VS_AVX2_VNNI)
const TileTable& avx2_vnni_table();
#endif
#if defined(CPU_CAPABILITY_AVX512)
const TileTable& avx512_table();
#if defined(VS_AVX512_VNNI)
const TileTable& avx512_vnni_table();
#endif
#endif
#endif

}  // namespace vs

namespace {

using vs::kMaxRows;
using vs::Packed;
using vs::TileFn;
using vs::TileTable;
constexpr int64_t kPrefetchGroups = 16;  // how far ahead the weights are prefetched

template <typename T>
inline int32_t lane(const T* x) {  // two int16 or four int8 activations, as one 32-bit lane
  int32_t v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

}  // namespace
