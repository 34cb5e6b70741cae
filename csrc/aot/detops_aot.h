/* detops C ABI: plain C entry points for host frameworks that load a function from a shared
 * library by name, e.g. MindSpore's ops.Custom("libdetops_aot.so:DetopsNms", ...,
 * func_type="aot"). Every entry has the signature
 *
 *   int Func(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
 *            void *stream, void *extra);
 *
 * params[i] is the data pointer of parameter i (inputs first, then outputs), ndims[i] its rank,
 * shapes[i] its ndims[i] sizes, dtypes[i] its dtype name ("float32", "float16", "float64",
 * "bfloat16", "int32", "int64"). Buffers are dense and row-major (C-contiguous). All buffers of a
 * call live on one device: host memory, or one CUDA device (found from the pointers); on CUDA the
 * work is queued on `stream` (a cudaStream_t; NULL is the default stream). `extra` is unused.
 *
 * The buffers are wrapped as tensors without copying and the same ops as detops::ops (and the
 * Python API) run on them; results are copied into the output buffers. An entry returns 0 on
 * success and a DetopsAotStatus code otherwise, before touching any buffer when the parameter
 * list itself is wrong (count, dtype names, ranks, shapes that disagree). It never throws;
 * DetopsAotLastError() gives the message of the last failure in the calling thread.
 *
 * DetopsNms (nparam 5)
 *   in   boxes          float [N, 4]   x1, y1, x2, y2; float32, float64, float16 or bfloat16
 *   in   scores         float [N]      same dtype as boxes
 *   in   iou_threshold  float32 [1]
 *   out  keep           int64 [N]      kept indices by decreasing score, then -1 padding
 *   out  count          int64 [1]      number of kept indices
 *
 * DetopsRoIAlignForward (nparam 4)
 *   in   input   float [B, C, H, W]
 *   in   rois    float [K, 5]          (batch index, x1, y1, x2, y2), same dtype as input
 *   in   attrs   float32 [3]           spatial_scale, sampling_ratio (an integer;
 *                                      <= 0: adaptive), aligned (0 or 1)
 *   out  output  float [K, C, PH, PW]  same dtype as input; PH, PW = pooled size
 *
 * DetopsRoIAlignBackward (nparam 4)
 *   in   grad        float [K, C, PH, PW]  gradient of the RoIAlign output
 *   in   rois        float [K, 5]          same dtype as grad
 *   in   attrs       float32 [3]           spatial_scale, sampling_ratio, aligned
 *   out  grad_input  float [B, C, H, W]    gradient of the input (overwritten)
 *
 * DetopsRoIPoolForward (nparam 4, or 5 with argmax)
 *   in   input   float [B, C, H, W]
 *   in   rois    float [K, 5]          same dtype as input
 *   in   attrs   float32 [1]           spatial_scale
 *   out  output  float [K, C, PH, PW]  max over each bin (0 for an empty bin)
 *   out  argmax  int32 [K, C, PH, PW]  (optional) flat h * W + w of each maximum, -1 if empty;
 *                                      without it no index is computed
 */
#ifndef DETOPS_AOT_H_
#define DETOPS_AOT_H_

#include <stdint.h>

#if defined(_WIN32)
#define DETOPS_AOT_API __declspec(dllexport)
#else
#define DETOPS_AOT_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum DetopsAotStatus {
  DETOPS_AOT_OK = 0,
  DETOPS_AOT_BAD_PARAM_COUNT = 1, /* nparam is not what the entry takes */
  DETOPS_AOT_BAD_POINTER = 2,     /* a NULL array, dtype name, shape or non-empty buffer */
  DETOPS_AOT_BAD_DTYPE = 3,       /* unknown dtype name, or a dtype the parameter does not take */
  DETOPS_AOT_BAD_SHAPE = 4,       /* wrong rank, negative size, or shapes that disagree */
  DETOPS_AOT_BAD_DEVICE = 5,      /* buffers on different devices, or CUDA without CUDA kernels */
  DETOPS_AOT_OP_ERROR = 6,        /* the op rejected its inputs or an attrs value (message in
                                     DetopsAotLastError) */
  DETOPS_AOT_INTERNAL = 7         /* any other failure */
};

DETOPS_AOT_API int DetopsNms(int nparam, void** params, int* ndims, int64_t** shapes,
                             const char** dtypes, void* stream, void* extra);
DETOPS_AOT_API int DetopsRoIAlignForward(int nparam, void** params, int* ndims, int64_t** shapes,
                                         const char** dtypes, void* stream, void* extra);
DETOPS_AOT_API int DetopsRoIAlignBackward(int nparam, void** params, int* ndims, int64_t** shapes,
                                          const char** dtypes, void* stream, void* extra);
DETOPS_AOT_API int DetopsRoIPoolForward(int nparam, void** params, int* ndims, int64_t** shapes,
                                        const char** dtypes, void* stream, void* extra);

/* Message of the last failed call in this thread ("" when none). */
DETOPS_AOT_API const char* DetopsAotLastError(void);

#ifdef __cplusplus
}
#endif

#endif /* DETOPS_AOT_H_ */
