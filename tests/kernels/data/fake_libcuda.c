/* A stand-in for the CUDA driver (libcuda.so.1) with the three entry points kernels/csrc/replay.cpp opens,
 * for tests/kernels/test_native_replay.py on a machine without a GPU. It launches nothing: it notes what it
 * is handed, reading each kernel parameter through the pointer array as the driver does (8 bytes of each
 * scalar: the replay keeps them in 8-byte slots; 128 of a tensor map), and its tensor maps hold the
 * encoding's arguments. */
#include <stdint.h>
#include <string.h>

typedef int CUresult;

static int expected_params = 0;
static int is_map[64];
static uint64_t noted[64][16];
static uint64_t launch_args[9];
static int launches = 0;

/* n parameters to note; those in maps (indices) are tensor maps, noted whole (128 bytes) */
void fake_expect_params(int n, const int* maps, int n_maps) {
  expected_params = n < 64 ? n : 64;
  memset(is_map, 0, sizeof(is_map));
  for (int i = 0; i < n_maps; ++i) is_map[maps[i]] = 1;
}
int fake_launches(void) { return launches; }
uint64_t fake_param(int i, int word) { return noted[i][word]; }
uint64_t fake_launch_arg(int i) { return launch_args[i]; }

CUresult cuGetErrorString(CUresult code, const char** text) {
  *text = code == 700 ? "fake illegal address" : "fake error";
  return 0;
}

/* function 0xdead fails as an illegal address would (code 700) */
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
  if ((uintptr_t)f == 0xdead) return 700;
  uint64_t args[9] = {(uintptr_t)f, gx, gy, gz, bx, by, bz, shared, (uintptr_t)stream};
  memcpy(launch_args, args, sizeof(args));
  for (int i = 0; i < expected_params; ++i) memcpy(noted[i], params[i], is_map[i] ? 128 : 8);
  (void)extra;
  launches += 1;
  return 0;
}

/* the map's words: address, dtype, rank, dims[5], strides[5], box[5], swizzle, fill (16 words = 128 bytes) */
CUresult cuTensorMapEncodeTiled(void* map, int dtype, uint32_t rank, void* address, const uint64_t* dims,
                                const uint64_t* strides, const uint32_t* box, const uint32_t* element_strides,
                                int interleave, int swizzle, int l2_promotion, int oob_fill) {
  uint64_t words[16] = {0};
  words[0] = (uintptr_t)address;
  words[1] = (uint64_t)dtype | ((uint64_t)interleave << 32) | ((uint64_t)l2_promotion << 40);
  words[2] = rank;
  for (uint32_t i = 0; i < rank && i < 4; ++i) {
    words[3 + i] = dims[i];
    words[7 + i] = i + 1 < rank ? strides[i] : 0;
    words[11 + i] = box[i] | ((uint64_t)element_strides[i] << 32);
  }
  words[15] = (uint64_t)swizzle | ((uint64_t)oob_fill << 32);
  memcpy(map, words, sizeof(words));
  return 0;
}
