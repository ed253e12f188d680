// Every kernel's start and end on the GPU, from CUPTI's activity records, for a process we
// do not rebuild: the GPU machine has no nsys, and ncu serializes kernels, so neither shows a
// graph-replayed step as it runs (programmatic launches overlapping). CUPTI reports the
// kernels of a graph node by node (graphId, graphNodeId), with the GPU's own timestamps.
//
// Build on the GPU machine (tools/gpu-lab/kernel_trace.sh finds CUPTI's header and library):
//   gcc -O2 -shared -fPIC -DKREC=CUpti_ActivityKernelN -I<cupti include> -I<cuda include>
//     tools/gpu-lab/kernel_trace.c -L<cupti lib> -lcupti -o libktrace.so
// Run:
//   CUDA_INJECTION64_PATH=$PWD/libktrace.so KTRACE_OUT=/tmp/k.tsv <any CUDA program>
// Output, one line per kernel: start_ns end_ns graph_id node_id stream grid block name;
// built with -DMREC=CUpti_ActivityMemcpyN, each copy too (grid and block "-").
// tools/gpu-lab/trace_step.py reads it.
#include <cuda.h>
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifndef KREC
#define KREC CUpti_ActivityKernel9
#endif

static FILE *out;
static unsigned long long dropped_total;

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  const size_t bytes = 8u << 20;
  *buffer = (uint8_t *)aligned_alloc(8, bytes);
  *size = *buffer ? bytes : 0;
  *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *record = NULL;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
#ifdef MREC
    if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      // Copies in the same columns: grid and block as "-", the name memcpy_<kind>_<bytes>
      // (kind: CUpti_ActivityMemcpyKind, 1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP).
      const MREC *m = (const MREC *)record;
      fprintf(out, "%llu\t%llu\t%u\t%llu\t%u\t-\t-\tmemcpy_%u_%llu\n", (unsigned long long)m->start,
              (unsigned long long)m->end, (unsigned)m->graphId, (unsigned long long)m->graphNodeId,
              (unsigned)m->streamId, (unsigned)m->copyKind, (unsigned long long)m->bytes);
    }
#endif
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const KREC *k = (const KREC *)record;
      fprintf(out, "%llu\t%llu\t%u\t%llu\t%u\t%d,%d,%d\t%d,%d,%d\t%s\n",
              (unsigned long long)k->start, (unsigned long long)k->end, (unsigned)k->graphId,
              (unsigned long long)k->graphNodeId, (unsigned)k->streamId, k->gridX, k->gridY,
              k->gridZ, k->blockX, k->blockY, k->blockZ, k->name ? k->name : "?");
    }
  }
  size_t dropped = 0;
  if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped) {
    dropped_total += dropped;
  }
  free(buffer);
}

static void flush_all(void) {
  cuptiActivityFlushAll(1);
  if (out) {
    if (dropped_total) fprintf(stderr, "kernel_trace: %llu records dropped\n", dropped_total);
    fflush(out);
  }
}

static void CUPTIAPI on_callback(void *user, CUpti_CallbackDomain domain, CUpti_CallbackId id,
                                 const void *data) {
  (void)user;
  (void)data;
  if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING)
    cuptiActivityFlushAll(1);
}

static int check(CUptiResult r, const char *what) {
  if (r == CUPTI_SUCCESS) return 0;
  const char *s = "?";
  cuptiGetResultString(r, &s);
  fprintf(stderr, "kernel_trace: %s failed: %s\n", what, s);
  return 1;
}

int InitializeInjection(void) {
  const char *path = getenv("KTRACE_OUT");
  out = fopen(path ? path : "ktrace.tsv", "w");
  if (!out) {
    fprintf(stderr, "kernel_trace: cannot open %s\n", path ? path : "ktrace.tsv");
    return 0;
  }
  CUpti_SubscriberHandle sub;
  if (check(cuptiSubscribe(&sub, (CUpti_CallbackFunc)on_callback, NULL), "cuptiSubscribe") ||
      check(cuptiEnableCallback(1, sub, CUPTI_CB_DOMAIN_RESOURCE,
                                CUPTI_CBID_RESOURCE_CONTEXT_DESTROY_STARTING),
            "cuptiEnableCallback") ||
      check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
            "cuptiActivityRegisterCallbacks") ||
      check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL),
            "cuptiActivityEnable(CONCURRENT_KERNEL)"))
    return 0;
#ifdef MREC
  if (check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "cuptiActivityEnable(MEMCPY)")) return 0;
#endif
  atexit(flush_all);
  fprintf(stderr, "kernel_trace: tracing kernels to %s\n", path ? path : "ktrace.tsv");
  return 1;
}
