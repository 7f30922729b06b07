/*
 * fakenvml.c - an ABI-compatible fake libnvidia-ml.so.1 for gpuguard's tests and simulation.
 *
 * The real nvidia-ml-py binding (`pynvml`) loads this file with CDLL("libnvidia-ml.so.1") and looks
 * symbols up by name, so gpuguard's NVML probe runs unchanged against a scenario instead of a GPU.
 * Struct layouts and the versioned symbol names follow nvidia-ml-py's ctypes definitions (pynvml.py),
 * which is the ABI this library must match.
 *
 * Build:  cc -shared -fPIC -O2 -Wall -Wextra -Werror -o libnvidia-ml.so.1 fakenvml.c -lpthread
 *
 * SCENARIO FILE
 * -------------
 * nvmlInit* reads the file named by $GPUGUARD_FAKE_NVML_FILE (read with getenv at init time, and
 * re-read on every init that finds the library uninitialised, so a test can switch scenarios between
 * nvmlShutdown and the next nvmlInit). Unset, empty or unreadable -> nvmlInit* returns
 * NVML_ERROR_DRIVER_NOT_LOADED (9).
 *
 * Format: one `key=value` per line. No quoting; the value runs to the end of the line and is trimmed
 * of surrounding blanks. Blank lines and lines starting with `#` are ignored, and so are unknown keys,
 * malformed lines, bad numbers, lines over 4095 bytes and lines holding NUL bytes. Integers are decimal
 * or 0x-hex (a leading 0 does NOT mean octal). A later line overrides an earlier one.
 *
 *   init_error=<nvmlReturn>             nvmlInit* returns this (default 0)
 *   driver_version=550.90.07            nvmlSystemGetDriverVersion
 *   nvml_version=12.550.90.07           nvmlSystemGetNVMLVersion
 *   cuda_driver_version=12040           nvmlSystemGetCudaDriverVersion(_v2)
 *   device_count=8                      default: highest gpu.<i> index seen + 1 (at most 64)
 *   hang.<function>=<seconds>           that function sleeps this long first (fractions allowed);
 *                                       hang.*=N applies to every function
 *   error.<function>=<nvmlReturn>       that function returns the error (after validating the handle);
 *                                       error.* applies to every function except nvmlInit* and nvmlShutdown
 *
 *   gpu.<i>.name=NVIDIA H100 80GB HBM3
 *   gpu.<i>.uuid=GPU-...                also found by nvmlDeviceGetHandleByUUID
 *   gpu.<i>.serial=1650123456789
 *   gpu.<i>.pci_bus_id=00000000:53:00.0 parsed into domain/bus/device; busId is re-printed the way
 *                                       NVML prints it ("%08X:%02X:%02X.0"), busIdLegacy "%04X:%02X:%02X.0"
 *   gpu.<i>.pci_device_id=0x233010DE    gpu.<i>.pci_subsystem_id=0x16C110DE   (default 0)
 *   gpu.<i>.minor=0
 *   gpu.<i>.memory_total=<bytes>        gpu.<i>.memory_used=<bytes>   (free = total - used; used default 0)
 *   gpu.<i>.ecc_current=0|1             gpu.<i>.ecc_pending=0|1   (either one makes nvmlDeviceGetEccMode work)
 *   gpu.<i>.ecc.volatile.uncorrected=N  gpu.<i>.ecc.volatile.corrected=N
 *   gpu.<i>.ecc.aggregate.uncorrected=N gpu.<i>.ecc.aggregate.corrected=N
 *   gpu.<i>.retired.sbe=N               gpu.<i>.retired.dbe=N   (page counts, at most 4096 each)
 *   gpu.<i>.retired.pending=0|1
 *   gpu.<i>.remap.correctable=N  gpu.<i>.remap.uncorrectable=N  gpu.<i>.remap.pending=0|1
 *   gpu.<i>.remap.failure=0|1           (any one makes nvmlDeviceGetRemappedRows work; others default 0)
 *   gpu.<i>.recovery_action=N           nvmlDeviceGetFieldValues field 230 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION),
 *                                       valueType unsigned int; every other field id -> NOT_SUPPORTED
 *   gpu.<i>.temperature=C  gpu.<i>.temp_slowdown=C  gpu.<i>.temp_shutdown=C
 *   gpu.<i>.temp_gpu_max=C gpu.<i>.temp_mem_max=C
 *   gpu.<i>.clocks_event_reasons=0x...  nvmlDeviceGetCurrentClocksEventReasons / ...ThrottleReasons
 *   gpu.<i>.clocks_event_reasons_supported=0x...  (default 0x1FF when clocks_event_reasons is set)
 *   gpu.<i>.pcie.gen_current=N  gpu.<i>.pcie.gen_max=N  gpu.<i>.pcie.gpu_gen_max=N
 *   gpu.<i>.pcie.width_current=N  gpu.<i>.pcie.width_max=N
 *   gpu.<i>.nvlink_count=18             links 0..count-1 exist (count at most 64), also field 91
 *                                       (NVML_FI_DEV_NVLINK_LINK_COUNT); a link index at or past
 *                                       max(18, count) -> INVALID_ARGUMENT (what the driver answers for
 *                                       indices past the bound), any other missing link -> NOT_SUPPORTED
 *   gpu.<i>.nvlink_down=3,5             these links report NVML_FEATURE_DISABLED (0), others ENABLED (1)
 *   gpu.<i>.power_usage=<mW>            gpu.<i>.power_limit=<mW> (nvmlDeviceGetEnforcedPowerLimit)
 *   gpu.<i>.utilization.gpu=N           gpu.<i>.utilization.memory=N
 *   gpu.<i>.clock.sm|mem|graphics|video=MHz   gpu.<i>.max_clock.sm|mem|graphics|video=MHz
 *   gpu.<i>.persistence_mode=0|1
 *   gpu.<i>.temp_memory=C               nvmlDeviceGetFieldValues field 82 (NVML_FI_DEV_MEMORY_TEMP, HBM)
 *   gpu.<i>.pcie.replay=N               nvmlDeviceGetPcieReplayCounter and field 94 (NVML_FI_DEV_PCIE_REPLAY_COUNTER)
 *   gpu.<i>.mig_current=0|1  gpu.<i>.mig_pending=0|1   nvmlDeviceGetMigMode (either one makes it work)
 *   gpu.<i>.mig.<n>=MIG-<uuid>          MIG device n (0..6): nvmlDeviceGetMaxMigDeviceCount is 7 while MIG is on,
 *                                       nvmlDeviceGetMigDeviceHandleByIndex gives a MIG handle (NOT_FOUND for an
 *                                       empty slot) whose nvmlDeviceGetUUID is this, and
 *                                       nvmlDeviceGetDeviceHandleFromMigDeviceHandle gives the GPU back
 *   gpu.<i>.fabric.state=0..3           nvmlDeviceGetGpuFabricInfo / ...InfoV (v2, v3): NOT_SUPPORTED, NOT_STARTED,
 *   gpu.<i>.fabric.status=<nvmlReturn>  IN_PROGRESS, COMPLETED; status, healthMask, healthSummary, cliqueId
 *   gpu.<i>.fabric.health_mask=0x...    gpu.<i>.fabric.health_summary=N  gpu.<i>.fabric.clique=N
 *                                       (no fabric.state: both calls return NOT_SUPPORTED, as older drivers do)
 *   gpu.<i>.process.<n>=<pid>:<used_bytes>[:live]  compute processes, n = 0..63 (gaps allowed); with
 *                                              ":live" listed only while that pid exists and is not a zombie
 *                                              (a process the test started; killing it frees "the GPU")
 *   gpu.<i>.error.<function>=<nvmlReturn>     that call on this GPU returns the error; error.* = every
 *                                       call on this GPU, nvmlDeviceGetHandleByIndex_v2 included
 *   gpu.<i>.hang.<function>=<seconds>   that call on this GPU sleeps first (adds to a global hang)
 *   gpu.<i>.field_error.<field id>=<nvmlReturn>  nvmlDeviceGetFieldValues succeeds but that one field carries
 *                                       this error (NVML reports per-field errors in each value's nvmlReturn)
 *
 * <function> is the exported symbol name, versions included (nvmlDeviceGetHandleByIndex_v2,
 * nvmlDeviceGetComputeRunningProcesses_v3, ...). <i> is the NVML index, 0..63.
 *
 * Rules: a per-GPU value that is absent makes its getter return NVML_ERROR_NOT_SUPPORTED, which is
 * how a GPU "does not support" something (an H100 has no retired pages). So do absent system values.
 * Before nvmlInit every function returns NVML_ERROR_UNINITIALIZED; init is reference counted like
 * NVML's. Bad handles, indices, enum values and NULL out-pointers -> NVML_ERROR_INVALID_ARGUMENT; a
 * short buffer -> NVML_ERROR_INSUFFICIENT_SIZE. nvmlErrorString never hangs or fails.
 */

#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------------------------ ABI */

typedef int nvmlReturn_t; /* an enum in nvml.h: int-sized, which is also ctypes' default restype */

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

enum { NVML_VALUE_TYPE_UNSIGNED_INT = 1, NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3 };
enum {
    NVML_FI_DEV_MEMORY_TEMP = 82,
    NVML_FI_DEV_NVLINK_LINK_COUNT = 91,
    NVML_FI_DEV_PCIE_REPLAY_COUNTER = 94,
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230,
};
#define MAX_MIG 7 /* at most 7 MIG devices per GPU (A100/H100) */
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

/* NVML_STRUCT_VERSION(name, ver) = sizeof(struct) | ver << 24 */
#define STRUCT_VERSION(type, ver) ((unsigned int)(sizeof(type) | ((unsigned int)(ver) << 24)))

struct fake_gpu;
typedef struct fake_gpu *nvmlDevice_t; /* NVML's handle is an opaque pointer: ours points into a static array */

typedef struct { /* nvmlPciInfo_t, filled by nvmlDeviceGetPciInfo_v3 */
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct { /* the layout the _v1/_v2 symbols fill: busId where v3 has busIdLegacy, then reserved */
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t;

typedef struct {
    unsigned long long total, free, used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

typedef struct { /* unversioned nvmlDeviceGet*RunningProcesses */
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct { /* _v2 and _v3 share this layout (pynvml: c_nvmlProcessInfo_v3_t = c_nvmlProcessInfo_v2_t) */
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct {
    unsigned int gpu, memory;
} nvmlUtilization_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    unsigned int version;
    unsigned int sensorType;
    int temperature;
} nvmlTemperature_v1_t;

typedef struct { /* nvmlGpuFabricInfo_t (unversioned nvmlDeviceGetGpuFabricInfo) */
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
} nvmlGpuFabricInfo_t;

typedef struct { /* nvmlGpuFabricInfo_v3_t; v2 is the same without healthSummary (36 bytes, version 0x02000024) */
    unsigned int version;
    unsigned char clusterUuid[16];
    nvmlReturn_t status;
    unsigned int cliqueId;
    unsigned int state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;
#define FABRIC_INFO_V2 0x02000024u
#define FABRIC_INFO_V3 0x03000028u

/* pynvml hard-codes these sizes through its ctypes structures; a mismatch would corrupt its memory. */
_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlPciInfo_v2_t) == 52, "nvmlPciInfo_v2_t layout");
_Static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");
_Static_assert(sizeof(nvmlFieldValue_t) == 40, "nvmlFieldValue_t layout");
_Static_assert(sizeof(nvmlTemperature_v1_t) == 12, "nvmlTemperature_v1_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_t) == 28, "nvmlGpuFabricInfo_t layout");
_Static_assert(sizeof(nvmlGpuFabricInfo_v3_t) == 40, "nvmlGpuFabricInfo_v3_t layout");

/* ------------------------------------------------------------------------------------- scenario */

#define MAX_GPUS 64
#define MAX_PROCS 64
#define MAX_OVERRIDES 32
#define NAME_MAX_LEN 96 /* function names and string values, NUL included */
#define LINE_MAX_LEN 4096
#define MAX_FILE_BYTES (16u << 20) /* stop reading a runaway file (e.g. /dev/zero) */
#define MAX_RETIRED_PAGES 4096ull
#define NVLINK_INDEX_BOUND 18u /* link indices at or past this are invalid, not merely unsupported */
#define MAX_NVLINKS 64u
#define MAX_HANG_SECONDS 1e7

enum gpu_field {
    F_MINOR, F_PCI_DEVICE_ID, F_PCI_SUBSYSTEM_ID,
    F_MEM_TOTAL, F_MEM_USED,
    F_ECC_CURRENT, F_ECC_PENDING,
    F_ECC_VOL_UNC, F_ECC_VOL_COR, F_ECC_AGG_UNC, F_ECC_AGG_COR,
    F_RETIRED_SBE, F_RETIRED_DBE, F_RETIRED_PENDING,
    F_REMAP_COR, F_REMAP_UNC, F_REMAP_PENDING, F_REMAP_FAILURE,
    F_RECOVERY_ACTION,
    F_TEMP, F_TEMP_SLOWDOWN, F_TEMP_SHUTDOWN, F_TEMP_GPU_MAX, F_TEMP_MEM_MAX,
    F_CLK_REASONS, F_CLK_REASONS_SUPPORTED,
    F_PCIE_GEN_CUR, F_PCIE_GEN_MAX, F_PCIE_GPU_GEN_MAX, F_PCIE_WIDTH_CUR, F_PCIE_WIDTH_MAX,
    F_NVLINK_COUNT,
    F_POWER, F_POWER_LIMIT,
    F_UTIL_GPU, F_UTIL_MEM,
    F_CLK_GRAPHICS, F_CLK_SM, F_CLK_MEM, F_CLK_VIDEO,
    F_MAXCLK_GRAPHICS, F_MAXCLK_SM, F_MAXCLK_MEM, F_MAXCLK_VIDEO,
    F_PERSISTENCE,
    F_TEMP_MEM, F_PCIE_REPLAY,
    F_MIG_CURRENT, F_MIG_PENDING,
    F_FABRIC_STATE, F_FABRIC_STATUS, F_FABRIC_HEALTH_MASK, F_FABRIC_HEALTH_SUMMARY, F_FABRIC_CLIQUE,
    F_COUNT
};

static const struct {
    const char *key;
    enum gpu_field field;
} GPU_NUMERIC_KEYS[] = {
    {"minor", F_MINOR},
    {"pci_device_id", F_PCI_DEVICE_ID},
    {"pci_subsystem_id", F_PCI_SUBSYSTEM_ID},
    {"memory_total", F_MEM_TOTAL},
    {"memory_used", F_MEM_USED},
    {"ecc_current", F_ECC_CURRENT},
    {"ecc_pending", F_ECC_PENDING},
    {"ecc.volatile.uncorrected", F_ECC_VOL_UNC},
    {"ecc.volatile.corrected", F_ECC_VOL_COR},
    {"ecc.aggregate.uncorrected", F_ECC_AGG_UNC},
    {"ecc.aggregate.corrected", F_ECC_AGG_COR},
    {"retired.sbe", F_RETIRED_SBE},
    {"retired.dbe", F_RETIRED_DBE},
    {"retired.pending", F_RETIRED_PENDING},
    {"remap.correctable", F_REMAP_COR},
    {"remap.uncorrectable", F_REMAP_UNC},
    {"remap.pending", F_REMAP_PENDING},
    {"remap.failure", F_REMAP_FAILURE},
    {"recovery_action", F_RECOVERY_ACTION},
    {"temperature", F_TEMP},
    {"temp_slowdown", F_TEMP_SLOWDOWN},
    {"temp_shutdown", F_TEMP_SHUTDOWN},
    {"temp_gpu_max", F_TEMP_GPU_MAX},
    {"temp_mem_max", F_TEMP_MEM_MAX},
    {"clocks_event_reasons", F_CLK_REASONS},
    {"clocks_event_reasons_supported", F_CLK_REASONS_SUPPORTED},
    {"pcie.gen_current", F_PCIE_GEN_CUR},
    {"pcie.gen_max", F_PCIE_GEN_MAX},
    {"pcie.gpu_gen_max", F_PCIE_GPU_GEN_MAX},
    {"pcie.width_current", F_PCIE_WIDTH_CUR},
    {"pcie.width_max", F_PCIE_WIDTH_MAX},
    {"nvlink_count", F_NVLINK_COUNT},
    {"power_usage", F_POWER},
    {"power_limit", F_POWER_LIMIT},
    {"utilization.gpu", F_UTIL_GPU},
    {"utilization.memory", F_UTIL_MEM},
    {"clock.graphics", F_CLK_GRAPHICS},
    {"clock.sm", F_CLK_SM},
    {"clock.mem", F_CLK_MEM},
    {"clock.video", F_CLK_VIDEO},
    {"max_clock.graphics", F_MAXCLK_GRAPHICS},
    {"max_clock.sm", F_MAXCLK_SM},
    {"max_clock.mem", F_MAXCLK_MEM},
    {"max_clock.video", F_MAXCLK_VIDEO},
    {"persistence_mode", F_PERSISTENCE},
    {"temp_memory", F_TEMP_MEM},
    {"pcie.replay", F_PCIE_REPLAY},
    {"mig_current", F_MIG_CURRENT},
    {"mig_pending", F_MIG_PENDING},
    {"fabric.state", F_FABRIC_STATE},
    {"fabric.status", F_FABRIC_STATUS},
    {"fabric.health_mask", F_FABRIC_HEALTH_MASK},
    {"fabric.health_summary", F_FABRIC_HEALTH_SUMMARY},
    {"fabric.clique", F_FABRIC_CLIQUE},
};

struct text {
    bool set;
    char s[NAME_MAX_LEN];
};

struct override {
    char function[NAME_MAX_LEN]; /* symbol name or "*" */
    double value;
};

struct override_list {
    int n;
    struct override items[MAX_OVERRIDES];
};

struct process {
    bool set;
    bool live; /* only while /proc/<pid> is a running (non-zombie) process */
    unsigned int pid;
    unsigned long long used_bytes;
};

struct fake_gpu {
    unsigned int index;
    bool has[F_COUNT];
    unsigned long long val[F_COUNT];
    struct text name, uuid, serial;
    bool has_pci;
    unsigned int pci_domain, pci_bus, pci_device;
    unsigned long long nvlink_down; /* bit n set = link n disabled */
    struct process procs[MAX_PROCS];
    struct text mig_uuid[MAX_MIG]; /* a MIG device handle points at one of these */
    struct override_list errors, hangs;
    struct override_list field_errors; /* "<field id>" -> nvmlReturn of that field in nvmlDeviceGetFieldValues */
};

struct scenario {
    nvmlReturn_t init_error;
    struct text driver_version, nvml_version;
    bool has_cuda_version;
    int cuda_version;
    bool has_device_count;
    unsigned int device_count;
    int highest_gpu_seen;
    struct override_list errors, hangs;
    struct fake_gpu gpus[MAX_GPUS];
};

/* The live scenario is static and overwritten in place (never freed), so a call still sleeping in a
 * hang from an earlier session reads stale but valid memory rather than freed memory. */
static struct scenario g_live;
static struct scenario g_staging;
static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_refcount;

/* -------------------------------------------------------------------------------------- parsing */

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\r')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = '\0';
    return s;
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Decimal or 0x-hex, optionally negative (wraps like C's unsigned conversion); whole string or fail. */
static bool parse_u64(const char *s, unsigned long long *out) {
    bool negative = false;
    if (*s == '-') {
        negative = true;
        s++;
    }
    unsigned base = 10;
    if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
        base = 16;
        s += 2;
    }
    if (*s == '\0')
        return false;
    unsigned long long v = 0;
    for (; *s; s++) {
        int d = hex_digit(*s);
        if (d < 0 || (unsigned)d >= base)
            return false;
        if (v > (~0ull - (unsigned)d) / base)
            return false; /* overflow */
        v = v * base + (unsigned)d;
    }
    *out = negative ? 0ull - v : v;
    return true;
}

static bool parse_int(const char *s, int *out) {
    unsigned long long v;
    if (!parse_u64(s, &v))
        return false;
    long long sv = (long long)v;
    if (sv < -2147483647LL - 1 || sv > 2147483647LL)
        return false;
    *out = (int)sv;
    return true;
}

static bool parse_seconds(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || errno != 0 || !isfinite(v) || v < 0)
        return false;
    *out = v > MAX_HANG_SECONDS ? MAX_HANG_SECONDS : v;
    return true;
}

static bool set_text(struct text *t, const char *value) {
    size_t n = strlen(value);
    if (n >= sizeof t->s)
        return false; /* refuse to truncate: a silently shortened UUID would be a different GPU */
    memcpy(t->s, value, n + 1);
    t->set = true;
    return true;
}

static bool valid_function_name(const char *s) {
    if (strcmp(s, "*") == 0)
        return true;
    if (*s == '\0' || strlen(s) >= NAME_MAX_LEN)
        return false;
    for (; *s; s++) {
        char c = *s;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'))
            return false;
    }
    return true;
}

static void add_override(struct override_list *list, const char *function, double value) {
    if (!valid_function_name(function))
        return;
    for (int i = 0; i < list->n; i++) {
        if (strcmp(list->items[i].function, function) == 0) {
            list->items[i].value = value;
            return;
        }
    }
    if (list->n >= MAX_OVERRIDES)
        return;
    struct override *o = &list->items[list->n++];
    memcpy(o->function, function, strlen(function) + 1);
    o->value = value;
}

/* "hang.<fn>" / "error.<fn>" -> true when `key` was one of them (handled or ignored). */
static bool parse_override_key(struct override_list *errors, struct override_list *hangs,
                               const char *key, const char *value) {
    if (strncmp(key, "hang.", 5) == 0) {
        double seconds;
        if (parse_seconds(value, &seconds))
            add_override(hangs, key + 5, seconds);
        return true;
    }
    if (strncmp(key, "error.", 6) == 0) {
        int code;
        if (parse_int(value, &code))
            add_override(errors, key + 6, (double)code);
        return true;
    }
    return false;
}

/* "0000:3b:00.0", "00000000:3B:00.0" or "3b:00.0" (domain 0); the function number is ignored. */
static bool parse_pci_bus_id(const char *s, unsigned *domain, unsigned *bus, unsigned *device) {
    unsigned long long parts[3];
    int nparts = 0;
    const char *p = s;
    while (nparts < 3) {
        unsigned long long v = 0;
        int digits = 0;
        for (; hex_digit(*p) >= 0; p++, digits++) {
            if (digits >= 8)
                return false;
            v = v * 16 + (unsigned)hex_digit(*p);
        }
        if (digits == 0)
            return false;
        parts[nparts++] = v;
        if (*p == ':') {
            p++;
            continue;
        }
        break;
    }
    if (*p != '.' || hex_digit(p[1]) < 0 || p[2] != '\0')
        return false;
    if (nparts == 2) {
        parts[2] = parts[1];
        parts[1] = parts[0];
        parts[0] = 0;
    } else if (nparts != 3) {
        return false;
    }
    if (parts[1] > 0xFF || parts[2] > 0x1F)
        return false;
    *domain = (unsigned)parts[0];
    *bus = (unsigned)parts[1];
    *device = (unsigned)parts[2];
    return true;
}

static void parse_nvlink_list(struct fake_gpu *g, char *value) {
    unsigned long long mask = 0;
    for (char *save = NULL, *tok = strtok_r(value, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        unsigned long long link;
        if (parse_u64(trim(tok), &link) && link < MAX_NVLINKS)
            mask |= 1ull << link;
    }
    g->nvlink_down = mask;
}

static void parse_process(struct fake_gpu *g, const char *slot, char *value) {
    unsigned long long n, pid, used;
    char *colon = strchr(value, ':');
    if (!parse_u64(slot, &n) || n >= MAX_PROCS || !colon)
        return;
    *colon = '\0';
    char *flag = strchr(colon + 1, ':');
    bool live = false;
    if (flag) {
        *flag = '\0';
        if (strcmp(trim(flag + 1), "live") != 0)
            return;
        live = true;
    }
    if (!parse_u64(trim(value), &pid) || pid > 0xFFFFFFFFull || !parse_u64(trim(colon + 1), &used))
        return;
    g->procs[n] = (struct process){.set = true, .live = live, .pid = (unsigned)pid, .used_bytes = used};
}

/* A ":live" process counts while /proc/<pid>/stat exists and its state is not Z (zombie) or X (dead). */
static bool process_visible(const struct process *p) {
    if (!p->set)
        return false;
    if (!p->live)
        return true;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%u/stat", p->pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *paren = strrchr(buf, ')');
    if (!paren || paren[1] != ' ')
        return false;
    return paren[2] != 'Z' && paren[2] != 'X' && paren[2] != '\0';
}

static void parse_gpu_key(struct scenario *sc, const char *key, char *value) {
    /* key is what follows "gpu.": "<i>.<rest>" */
    unsigned idx = 0;
    int digits = 0;
    for (; *key >= '0' && *key <= '9'; key++, digits++) {
        idx = idx * 10 + (unsigned)(*key - '0');
        if (idx >= MAX_GPUS)
            return;
    }
    if (digits == 0 || *key != '.')
        return;
    const char *rest = key + 1;
    struct fake_gpu *g = &sc->gpus[idx];
    if ((int)idx > sc->highest_gpu_seen)
        sc->highest_gpu_seen = (int)idx;

    for (size_t i = 0; i < sizeof GPU_NUMERIC_KEYS / sizeof GPU_NUMERIC_KEYS[0]; i++) {
        if (strcmp(rest, GPU_NUMERIC_KEYS[i].key) == 0) {
            unsigned long long v;
            if (parse_u64(value, &v)) {
                g->val[GPU_NUMERIC_KEYS[i].field] = v;
                g->has[GPU_NUMERIC_KEYS[i].field] = true;
            }
            return;
        }
    }
    if (strcmp(rest, "name") == 0)
        set_text(&g->name, value);
    else if (strcmp(rest, "uuid") == 0)
        set_text(&g->uuid, value);
    else if (strcmp(rest, "serial") == 0)
        set_text(&g->serial, value);
    else if (strcmp(rest, "pci_bus_id") == 0)
        g->has_pci = parse_pci_bus_id(value, &g->pci_domain, &g->pci_bus, &g->pci_device) || g->has_pci;
    else if (strcmp(rest, "nvlink_down") == 0)
        parse_nvlink_list(g, value);
    else if (strncmp(rest, "process.", 8) == 0)
        parse_process(g, rest + 8, value);
    else if (strncmp(rest, "mig.", 4) == 0 && rest[4] >= '0' && rest[4] < '0' + MAX_MIG && rest[5] == '\0')
        set_text(&g->mig_uuid[rest[4] - '0'], value);
    else if (strncmp(rest, "field_error.", 12) == 0) {
        int code;
        if (parse_int(value, &code))
            add_override(&g->field_errors, rest + 12, (double)code);
    } else
        parse_override_key(&g->errors, &g->hangs, rest, value);
}

static void parse_line(struct scenario *sc, char *line) {
    line = trim(line);
    if (*line == '\0' || *line == '#')
        return;
    char *eq = strchr(line, '=');
    if (!eq)
        return;
    *eq = '\0';
    char *key = trim(line);
    char *value = trim(eq + 1);

    if (strncmp(key, "gpu.", 4) == 0) {
        parse_gpu_key(sc, key + 4, value);
    } else if (strcmp(key, "init_error") == 0) {
        int v;
        if (parse_int(value, &v))
            sc->init_error = v;
    } else if (strcmp(key, "driver_version") == 0) {
        set_text(&sc->driver_version, value);
    } else if (strcmp(key, "nvml_version") == 0) {
        set_text(&sc->nvml_version, value);
    } else if (strcmp(key, "cuda_driver_version") == 0) {
        sc->has_cuda_version = parse_int(value, &sc->cuda_version) || sc->has_cuda_version;
    } else if (strcmp(key, "device_count") == 0) {
        unsigned long long v;
        if (parse_u64(value, &v)) {
            sc->device_count = v > MAX_GPUS ? MAX_GPUS : (unsigned)v;
            sc->has_device_count = true;
        }
    } else {
        parse_override_key(&sc->errors, &sc->hangs, key, value);
    }
}

static void reset_scenario(struct scenario *sc) {
    memset(sc, 0, sizeof *sc);
    sc->highest_gpu_seen = -1;
    for (unsigned i = 0; i < MAX_GPUS; i++)
        sc->gpus[i].index = i;
}

/* Reads lines byte by byte so that NUL bytes and overlong lines are detected exactly. */
static bool parse_stream(struct scenario *sc, FILE *f) {
    char line[LINE_MAX_LEN];
    size_t n = 0, total = 0;
    bool bad_line = false;
    int c;
    while ((c = getc(f)) != EOF && total++ < MAX_FILE_BYTES) {
        if (c == '\n') {
            if (!bad_line) {
                line[n] = '\0';
                parse_line(sc, line);
            }
            n = 0;
            bad_line = false;
        } else if (c == '\0' || n + 1 >= sizeof line) {
            bad_line = true;
        } else {
            line[n++] = (char)c;
        }
    }
    if (ferror(f))
        return false; /* e.g. the path is a directory */
    if (n > 0 && !bad_line) {
        line[n] = '\0';
        parse_line(sc, line);
    }
    return true;
}

/* Called with g_init_lock held and no session open. */
static bool load_scenario_from_env(void) {
    const char *path = getenv("GPUGUARD_FAKE_NVML_FILE");
    if (!path || !*path)
        return false;
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    reset_scenario(&g_staging);
    bool ok = parse_stream(&g_staging, f);
    fclose(f);
    if (!ok)
        return false;
    if (!g_staging.has_device_count)
        g_staging.device_count = (unsigned)(g_staging.highest_gpu_seen + 1);
    memcpy(&g_live, &g_staging, sizeof g_live);
    return true;
}

/* ---------------------------------------------------------------------- the helper every call uses */

static bool initialized(void) { return atomic_load(&g_refcount) > 0; }

static unsigned device_count(void) { return g_live.device_count; }

/* An exact symbol name beats the "*" wildcard. */
static bool find_override(const struct override_list *list, const char *function, bool allow_wildcard,
                          double *out) {
    const struct override *wildcard = NULL;
    for (int i = 0; i < list->n && i < MAX_OVERRIDES; i++) {
        const struct override *o = &list->items[i];
        if (strcmp(o->function, function) == 0) {
            *out = o->value;
            return true;
        }
        if (allow_wildcard && strcmp(o->function, "*") == 0)
            wildcard = o;
    }
    if (wildcard)
        *out = wildcard->value;
    return wildcard != NULL;
}

static void sleep_seconds(double seconds) {
    if (!(seconds > 0))
        return;
    time_t whole = (time_t)seconds;
    struct timespec left = {.tv_sec = whole, .tv_nsec = (long)((seconds - (double)whole) * 1e9)};
    while (nanosleep(&left, &left) != 0 && errno == EINTR) {
    }
}

static void apply_hangs(const char *function, const struct fake_gpu *g) {
    double seconds = 0, v;
    if (find_override(&g_live.hangs, function, true, &v))
        seconds += v;
    if (g && find_override(&g->hangs, function, true, &v))
        seconds += v;
    sleep_seconds(seconds);
}

/* What every NVML entry point (except init and nvmlErrorString) does first: refuse before init, sleep
 * for a configured hang, then return a configured error. `g` is the GPU the call is about, or NULL. */
static nvmlReturn_t begin(const char *function, const struct fake_gpu *g) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    apply_hangs(function, g);
    bool is_shutdown = strcmp(function, "nvmlShutdown") == 0;
    double v;
    if (g && find_override(&g->errors, function, !is_shutdown, &v) && v != 0)
        return (nvmlReturn_t)v;
    /* error.* must not break nvmlShutdown, or a session could never close and re-read its scenario */
    if (find_override(&g_live.errors, function, !is_shutdown, &v) && v != 0)
        return (nvmlReturn_t)v;
    return NVML_SUCCESS;
}

static struct fake_gpu *gpu_from_handle(nvmlDevice_t dev) {
    uintptr_t p = (uintptr_t)dev, base = (uintptr_t)&g_live.gpus[0];
    if (p < base || (p - base) % sizeof(struct fake_gpu) != 0)
        return NULL;
    size_t i = (p - base) / sizeof(struct fake_gpu);
    return i < device_count() ? &g_live.gpus[i] : NULL;
}

/* begin() for calls that take a device handle. */
static nvmlReturn_t begin_device(const char *function, nvmlDevice_t dev, const struct fake_gpu **out) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    const struct fake_gpu *g = gpu_from_handle(dev);
    if (!g)
        return NVML_ERROR_INVALID_ARGUMENT;
    *out = g;
    return begin(function, g);
}

static nvmlReturn_t field_u64(const struct fake_gpu *g, enum gpu_field f, unsigned long long *out) {
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[f])
        return NVML_ERROR_NOT_SUPPORTED;
    *out = g->val[f];
    return NVML_SUCCESS;
}

static nvmlReturn_t field_uint(const struct fake_gpu *g, enum gpu_field f, unsigned int *out) {
    if (!out)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[f])
        return NVML_ERROR_NOT_SUPPORTED;
    *out = (unsigned int)g->val[f];
    return NVML_SUCCESS;
}

/* The whole body of every "one unsigned int per device" getter. */
static nvmlReturn_t device_uint(const char *function, nvmlDevice_t dev, enum gpu_field f, unsigned int *out) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    return rc != NVML_SUCCESS ? rc : field_uint(g, f, out);
}

static nvmlReturn_t device_u64(const char *function, nvmlDevice_t dev, enum gpu_field f, unsigned long long *out) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    return rc != NVML_SUCCESS ? rc : field_u64(g, f, out);
}

static nvmlReturn_t copy_text(const struct text *t, char *buf, unsigned int length) {
    if (!buf)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!t->set)
        return NVML_ERROR_NOT_SUPPORTED;
    size_t n = strnlen(t->s, sizeof t->s - 1);
    if (length < n + 1)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(buf, t->s, n);
    buf[n] = '\0';
    return NVML_SUCCESS;
}

/* -------------------------------------------------------------------------------- init/shutdown */

static nvmlReturn_t init_common(const char *function) {
    pthread_mutex_lock(&g_init_lock);
    bool loaded = initialized() || load_scenario_from_env();
    pthread_mutex_unlock(&g_init_lock);
    if (!loaded)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    apply_hangs(function, NULL);
    if (g_live.init_error != NVML_SUCCESS)
        return g_live.init_error;
    atomic_fetch_add(&g_refcount, 1);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit(void) { return init_common(__func__); }
nvmlReturn_t nvmlInit_v2(void) { return init_common(__func__); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags; /* NO_GPUS / NO_ATTACH only change how real NVML talks to the driver */
    return init_common(__func__);
}

nvmlReturn_t nvmlShutdown(void) {
    nvmlReturn_t rc = begin(__func__, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    pthread_mutex_lock(&g_init_lock);
    int count = atomic_load(&g_refcount);
    if (count > 0)
        atomic_store(&g_refcount, count - 1);
    pthread_mutex_unlock(&g_init_lock);
    return count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    /* The strings libnvidia-ml returns (e.g. nvidia-smi's "Driver/library version mismatch"). */
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt Request Issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires reset";
    case 17: return "GPU access blocked by the operating system";
    case 18: return "Driver/library version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 22: return "The requested vgpu operation is not available on target device, because ECC is enabled";
    case 23: return "Insufficient Resources";
    case 24: return "Frequency not supported";
    case 25: return "Argument version mismatch";
    case 26: return "Deprecated";
    case 27: return "Not Ready";
    case 28: return "GPU not found";
    case 29: return "Invalid state";
    case 30: return "Reset type not supported";
    default: return "Unknown Error";
    }
}

/* ---------------------------------------------------------------------------------------- system */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = begin(__func__, NULL);
    return rc != NVML_SUCCESS ? rc : copy_text(&g_live.driver_version, version, length);
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = begin(__func__, NULL);
    return rc != NVML_SUCCESS ? rc : copy_text(&g_live.nvml_version, version, length);
}

static nvmlReturn_t cuda_driver_version(const char *function, int *version) {
    nvmlReturn_t rc = begin(function, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!version)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g_live.has_cuda_version)
        return NVML_ERROR_NOT_SUPPORTED;
    *version = g_live.cuda_version;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return cuda_driver_version(__func__, v); }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return cuda_driver_version(__func__, v); }

/* -------------------------------------------------------------------------------- enumeration */

static nvmlReturn_t get_count(const char *function, unsigned int *count) {
    nvmlReturn_t rc = begin(function, NULL);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *count = device_count();
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return get_count(__func__, count); }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) { return get_count(__func__, count); }

/* Lookups: the GPU they resolve to (if any) gets its errors/hangs applied, like any call on it. */
static nvmlReturn_t hand_out(const char *function, struct fake_gpu *g, nvmlReturn_t miss, nvmlDevice_t *device) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = begin(function, g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g)
        return miss;
    *device = g;
    return NVML_SUCCESS;
}

static nvmlReturn_t by_index(const char *function, unsigned int index, nvmlDevice_t *device) {
    struct fake_gpu *g = index < device_count() ? &g_live.gpus[index] : NULL;
    return hand_out(function, g, NVML_ERROR_INVALID_ARGUMENT, device);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) { return by_index(__func__, i, d); }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) { return by_index(__func__, i, d); }

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!uuid)
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *found = NULL;
    for (unsigned i = 0; i < device_count() && !found; i++)
        if (g_live.gpus[i].uuid.set && strcmp(g_live.gpus[i].uuid.s, uuid) == 0)
            found = &g_live.gpus[i];
    return hand_out(__func__, found, NVML_ERROR_NOT_FOUND, device);
}

static nvmlReturn_t by_pci(const char *function, const char *bus_id, nvmlDevice_t *device) {
    unsigned domain, bus, dev;
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!bus_id || !parse_pci_bus_id(bus_id, &domain, &bus, &dev))
        return NVML_ERROR_INVALID_ARGUMENT;
    struct fake_gpu *found = NULL;
    for (unsigned i = 0; i < device_count() && !found; i++) {
        struct fake_gpu *g = &g_live.gpus[i];
        if (g->has_pci && g->pci_domain == domain && g->pci_bus == bus && g->pci_device == dev)
            found = g;
    }
    return hand_out(function, found, NVML_ERROR_NOT_FOUND, device);
}

nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char *id, nvmlDevice_t *d) { return by_pci(__func__, id, d); }
nvmlReturn_t nvmlDeviceGetHandleByPciBusId_v2(const char *id, nvmlDevice_t *d) { return by_pci(__func__, id, d); }

/* ------------------------------------------------------------------------------------- identity */

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t dev, unsigned int *index) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!index)
        return NVML_ERROR_INVALID_ARGUMENT;
    *index = g->index;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *m) { return device_uint(__func__, d, F_MINOR, m); }

static nvmlReturn_t device_text(const char *function, nvmlDevice_t dev, size_t offset, char *buf, unsigned int length) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    return rc != NVML_SUCCESS ? rc : copy_text((const struct text *)((const char *)g + offset), buf, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *buf, unsigned int n) {
    return device_text(__func__, d, offsetof(struct fake_gpu, name), buf, n);
}
/* A MIG device handle points at gpus[i].mig_uuid[n]: never at a multiple of sizeof(struct fake_gpu), so
 * gpu_from_handle() rejects it and only the MIG-aware calls accept it. */
static struct fake_gpu *mig_parent(nvmlDevice_t dev, const struct text **uuid) {
    uintptr_t p = (uintptr_t)dev;
    for (unsigned i = 0; i < device_count(); i++) {
        struct fake_gpu *g = &g_live.gpus[i];
        uintptr_t lo = (uintptr_t)&g->mig_uuid[0], hi = (uintptr_t)&g->mig_uuid[MAX_MIG];
        if (p >= lo && p < hi && (p - lo) % sizeof(struct text) == 0) {
            const struct text *t = (const struct text *)p;
            if (!t->set)
                return NULL;
            if (uuid)
                *uuid = t;
            return g;
        }
    }
    return NULL;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *buf, unsigned int n) {
    const struct text *mig;
    const struct fake_gpu *parent = initialized() ? mig_parent(d, &mig) : NULL;
    if (parent) {
        nvmlReturn_t rc = begin(__func__, parent);
        return rc != NVML_SUCCESS ? rc : copy_text(mig, buf, n);
    }
    return device_text(__func__, d, offsetof(struct fake_gpu, uuid), buf, n);
}
nvmlReturn_t nvmlDeviceGetSerial(nvmlDevice_t d, char *buf, unsigned int n) {
    return device_text(__func__, d, offsetof(struct fake_gpu, serial), buf, n);
}

static void fill_pci_common(const struct fake_gpu *g, unsigned *domain, unsigned *bus, unsigned *device,
                            unsigned *device_id, unsigned *subsystem_id, char *legacy, size_t legacy_len) {
    *domain = g->pci_domain;
    *bus = g->pci_bus;
    *device = g->pci_device;
    *device_id = (unsigned)g->val[F_PCI_DEVICE_ID];
    *subsystem_id = (unsigned)g->val[F_PCI_SUBSYSTEM_ID];
    snprintf(legacy, legacy_len, "%04X:%02X:%02X.0", g->pci_domain & 0xFFFFu, g->pci_bus, g->pci_device);
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t dev, nvmlPciInfo_t *pci) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has_pci)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(pci, 0, sizeof *pci);
    fill_pci_common(g, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId,
                    pci->busIdLegacy, sizeof pci->busIdLegacy);
    snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", g->pci_domain, g->pci_bus, g->pci_device);
    return NVML_SUCCESS;
}

static nvmlReturn_t pci_info_v2(const char *function, nvmlDevice_t dev, nvmlPciInfo_v2_t *pci) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has_pci)
        return NVML_ERROR_NOT_SUPPORTED;
    memset(pci, 0, sizeof *pci); /* only 52 bytes: the old struct has no room for the 32-byte busId */
    fill_pci_common(g, &pci->domain, &pci->bus, &pci->device, &pci->pciDeviceId, &pci->pciSubSystemId,
                    pci->busId, sizeof pci->busId);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo(nvmlDevice_t d, nvmlPciInfo_v2_t *p) { return pci_info_v2(__func__, d, p); }
nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t d, nvmlPciInfo_v2_t *p) { return pci_info_v2(__func__, d, p); }

nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t d, unsigned int *mode) {
    return device_uint(__func__, d, F_PERSISTENCE, mode);
}

/* --------------------------------------------------------------------------------------- memory */

static void memory_numbers(const struct fake_gpu *g, unsigned long long *total, unsigned long long *used,
                           unsigned long long *free_bytes) {
    *total = g->val[F_MEM_TOTAL];
    *used = g->has[F_MEM_USED] ? g->val[F_MEM_USED] : 0;
    *free_bytes = *used < *total ? *total - *used : 0;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t dev, nvmlMemory_t *mem) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_MEM_TOTAL])
        return NVML_ERROR_NOT_SUPPORTED;
    memory_numbers(g, &mem->total, &mem->used, &mem->free);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t dev, nvmlMemory_v2_t *mem) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mem)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mem->version != STRUCT_VERSION(nvmlMemory_v2_t, 2))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!g->has[F_MEM_TOTAL])
        return NVML_ERROR_NOT_SUPPORTED;
    mem->reserved = 0;
    memory_numbers(g, &mem->total, &mem->used, &mem->free);
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------ ECC and retirement */

nvmlReturn_t nvmlDeviceGetEccMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    bool has_cur = g->has[F_ECC_CURRENT], has_pend = g->has[F_ECC_PENDING];
    if (!has_cur && !has_pend)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = (unsigned)(has_cur ? g->val[F_ECC_CURRENT] : g->val[F_ECC_PENDING]);
    *pending = (unsigned)(has_pend ? g->val[F_ECC_PENDING] : g->val[F_ECC_CURRENT]);
    return NVML_SUCCESS;
}

/* errorType 0 = corrected, 1 = uncorrected; counterType 0 = volatile, 1 = aggregate */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t dev, unsigned int errorType, unsigned int counterType,
                                         unsigned long long *count) {
    static const enum gpu_field fields[2][2] = {{F_ECC_VOL_COR, F_ECC_VOL_UNC}, {F_ECC_AGG_COR, F_ECC_AGG_UNC}};
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (errorType > 1 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    return field_u64(g, fields[counterType][errorType], count);
}

static nvmlReturn_t retired_pages(const char *function, nvmlDevice_t dev, unsigned int cause, unsigned int *count,
                                  unsigned long long *addresses, unsigned long long *timestamps) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (cause > 1 || !count)
        return NVML_ERROR_INVALID_ARGUMENT;
    enum gpu_field f = cause == 0 ? F_RETIRED_SBE : F_RETIRED_DBE;
    if (!g->has[f])
        return NVML_ERROR_NOT_SUPPORTED;
    unsigned n = (unsigned)(g->val[f] < MAX_RETIRED_PAGES ? g->val[f] : MAX_RETIRED_PAGES);
    if (*count < n) {
        *count = n; /* the size query pynvml makes first */
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !addresses)
        return NVML_ERROR_INVALID_ARGUMENT;
    for (unsigned i = 0; i < n; i++) {
        /* distinct, page-aligned, and different per cause so the two lists never overlap */
        addresses[i] = 0x100000000ull * (cause + 1) + 0x1000ull * i;
        if (timestamps)
            timestamps[i] = 1700000000ull + i;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, unsigned int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    return retired_pages(__func__, d, cause, count, addresses, NULL);
}

nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t d, unsigned int cause, unsigned int *count,
                                          unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_pages(__func__, d, cause, count, addresses, timestamps);
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, unsigned int *pending) {
    return device_uint(__func__, d, F_RETIRED_PENDING, pending);
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t dev, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!corr || !unc || !pending || !failure)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_REMAP_COR] && !g->has[F_REMAP_UNC] && !g->has[F_REMAP_PENDING] && !g->has[F_REMAP_FAILURE])
        return NVML_ERROR_NOT_SUPPORTED;
    *corr = (unsigned)g->val[F_REMAP_COR]; /* absent ones are 0: the scenario was zero-filled */
    *unc = (unsigned)g->val[F_REMAP_UNC];
    *pending = (unsigned)g->val[F_REMAP_PENDING];
    *failure = (unsigned)g->val[F_REMAP_FAILURE];
    return NVML_SUCCESS;
}

static long long now_usec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

/* The call succeeds as a whole; each entry carries its own nvmlReturn, as in NVML. */
nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t dev, int valuesCount, nvmlFieldValue_t *values) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (valuesCount < 0 || (valuesCount > 0 && !values))
        return NVML_ERROR_INVALID_ARGUMENT;
    long long now = now_usec();
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *fv = &values[i];
        fv->timestamp = now;
        fv->latencyUsec = 0;
        enum gpu_field f = F_COUNT;
        unsigned type = NVML_VALUE_TYPE_UNSIGNED_INT;
        char id[16];
        double code;
        snprintf(id, sizeof id, "%u", fv->fieldId);
        if (find_override(&g->field_errors, id, false, &code) && code != 0) {
            fv->nvmlReturn = (nvmlReturn_t)code;
            continue;
        }
        if (fv->fieldId == NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
            f = F_RECOVERY_ACTION;
        else if (fv->fieldId == NVML_FI_DEV_NVLINK_LINK_COUNT)
            f = F_NVLINK_COUNT;
        else if (fv->fieldId == NVML_FI_DEV_MEMORY_TEMP)
            f = F_TEMP_MEM;
        else if (fv->fieldId == NVML_FI_DEV_PCIE_REPLAY_COUNTER) {
            f = F_PCIE_REPLAY;
            type = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG;
        }
        if (f != F_COUNT && g->has[f]) {
            fv->valueType = type;
            fv->value.ullVal = 0;
            if (type == NVML_VALUE_TYPE_UNSIGNED_INT)
                fv->value.uiVal = (unsigned)g->val[f];
            else
                fv->value.ullVal = g->val[f];
            fv->nvmlReturn = NVML_SUCCESS;
        } else {
            fv->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------- temperature */

static nvmlReturn_t gpu_temperature(const struct fake_gpu *g, unsigned int sensor, long long *out) {
    if (sensor != 0) /* NVML_TEMPERATURE_GPU is the only sensor */
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_TEMP])
        return NVML_ERROR_NOT_SUPPORTED;
    *out = (long long)g->val[F_TEMP];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t dev, unsigned int sensor, unsigned int *temp) {
    const struct fake_gpu *g;
    long long t;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!temp)
        return NVML_ERROR_INVALID_ARGUMENT;
    if ((rc = gpu_temperature(g, sensor, &t)) == NVML_SUCCESS)
        *temp = (unsigned)t;
    return rc;
}

nvmlReturn_t nvmlDeviceGetTemperatureV(nvmlDevice_t dev, nvmlTemperature_v1_t *temp) {
    const struct fake_gpu *g;
    long long t;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!temp)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (temp->version != STRUCT_VERSION(nvmlTemperature_v1_t, 1))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((rc = gpu_temperature(g, temp->sensorType, &t)) == NVML_SUCCESS)
        temp->temperature = (int)t;
    return rc;
}

/* 0 SHUTDOWN, 1 SLOWDOWN, 2 MEM_MAX, 3 GPU_MAX; 4..7 (acoustic, GPS) exist but are not simulated */
nvmlReturn_t nvmlDeviceGetTemperatureThreshold(nvmlDevice_t dev, unsigned int type, unsigned int *temp) {
    static const enum gpu_field fields[] = {F_TEMP_SHUTDOWN, F_TEMP_SLOWDOWN, F_TEMP_MEM_MAX, F_TEMP_GPU_MAX};
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (type >= 8 || !temp)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (type >= 4)
        return NVML_ERROR_NOT_SUPPORTED;
    return field_uint(g, fields[type], temp);
}

/* ------------------------------------------------------------------------------- clocks and power */

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *r) {
    return device_u64(__func__, d, F_CLK_REASONS, r);
}
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    return device_u64(__func__, d, F_CLK_REASONS, r);
}

static nvmlReturn_t supported_reasons(const char *function, nvmlDevice_t dev, unsigned long long *reasons) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (g->has[F_CLK_REASONS_SUPPORTED] || !g->has[F_CLK_REASONS])
        return field_u64(g, F_CLK_REASONS_SUPPORTED, reasons);
    if (!reasons)
        return NVML_ERROR_INVALID_ARGUMENT;
    *reasons = 0x1FFull; /* GpuIdle .. DisplayClockSetting: every reason a datacenter GPU reports */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedClocksEventReasons(nvmlDevice_t d, unsigned long long *r) {
    return supported_reasons(__func__, d, r);
}
nvmlReturn_t nvmlDeviceGetSupportedClocksThrottleReasons(nvmlDevice_t d, unsigned long long *r) {
    return supported_reasons(__func__, d, r);
}

/* clockType 0 GRAPHICS, 1 SM, 2 MEM, 3 VIDEO */
static nvmlReturn_t clock_info(const char *function, nvmlDevice_t dev, unsigned int type, bool max,
                               unsigned int *mhz) {
    static const enum gpu_field current[] = {F_CLK_GRAPHICS, F_CLK_SM, F_CLK_MEM, F_CLK_VIDEO};
    static const enum gpu_field maximum[] = {F_MAXCLK_GRAPHICS, F_MAXCLK_SM, F_MAXCLK_MEM, F_MAXCLK_VIDEO};
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (type >= 4)
        return NVML_ERROR_INVALID_ARGUMENT;
    return field_uint(g, max ? maximum[type] : current[type], mhz);
}

nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz) {
    return clock_info(__func__, d, type, false, mhz);
}
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t d, unsigned int type, unsigned int *mhz) {
    return clock_info(__func__, d, type, true, mhz);
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *mw) { return device_uint(__func__, d, F_POWER, mw); }
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned int *mw) {
    return device_uint(__func__, d, F_POWER_LIMIT, mw);
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t dev, nvmlUtilization_t *util) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!util)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_UTIL_GPU] && !g->has[F_UTIL_MEM])
        return NVML_ERROR_NOT_SUPPORTED;
    util->gpu = (unsigned)g->val[F_UTIL_GPU];
    util->memory = (unsigned)g->val[F_UTIL_MEM];
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------------------------- PCIe, NVLink */

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_GEN_CUR, v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_GEN_MAX, v);
}
nvmlReturn_t nvmlDeviceGetGpuMaxPcieLinkGeneration(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_GPU_GEN_MAX, v);
}
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_WIDTH_CUR, v);
}
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_WIDTH_MAX, v);
}
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t d, unsigned int *v) {
    return device_uint(__func__, d, F_PCIE_REPLAY, v);
}

/* ------------------------------------------------------------------------------------------- MIG */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t dev, unsigned int *current, unsigned int *pending) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_MIG_CURRENT] && !g->has[F_MIG_PENDING])
        return NVML_ERROR_NOT_SUPPORTED;
    *current = (unsigned)g->val[F_MIG_CURRENT];
    *pending = g->has[F_MIG_PENDING] ? (unsigned)g->val[F_MIG_PENDING] : *current;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t dev, unsigned int *count) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->has[F_MIG_CURRENT] && !g->has[F_MIG_PENDING])
        return NVML_ERROR_NOT_SUPPORTED;
    *count = g->val[F_MIG_CURRENT] ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t dev, unsigned int index, nvmlDevice_t *mig) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!mig || index >= MAX_MIG)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (!g->val[F_MIG_CURRENT])
        return NVML_ERROR_NOT_SUPPORTED;
    if (!g->mig_uuid[index].set)
        return NVML_ERROR_NOT_FOUND;
    *mig = (nvmlDevice_t)(uintptr_t)&g->mig_uuid[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t mig, nvmlDevice_t *dev) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    struct fake_gpu *g = mig_parent(mig, NULL);
    if (!g || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = begin(__func__, g);
    if (rc == NVML_SUCCESS)
        *dev = g;
    return rc;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t dev, unsigned int *isMig) {
    if (!initialized())
        return NVML_ERROR_UNINITIALIZED;
    if (!isMig)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (mig_parent(dev, NULL)) {
        *isMig = 1;
        return NVML_SUCCESS;
    }
    if (!gpu_from_handle(dev))
        return NVML_ERROR_INVALID_ARGUMENT;
    *isMig = 0;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------- GPU fabric (NVSwitch) */

/* The fields every version of the fabric info shares; NOT_SUPPORTED when the scenario sets no fabric state. */
static nvmlReturn_t fabric_common(const struct fake_gpu *g, unsigned char *uuid, size_t uuid_len,
                                  nvmlReturn_t *status, unsigned int *clique, unsigned int *state) {
    if (!g->has[F_FABRIC_STATE])
        return NVML_ERROR_NOT_SUPPORTED;
    memset(uuid, 0, uuid_len);
    *status = (nvmlReturn_t)g->val[F_FABRIC_STATUS];
    *clique = (unsigned)g->val[F_FABRIC_CLIQUE];
    *state = (unsigned)g->val[F_FABRIC_STATE];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t dev, nvmlGpuFabricInfo_t *info) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    return fabric_common(g, info->clusterUuid, sizeof info->clusterUuid, &info->status, &info->cliqueId,
                         &info->state);
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t dev, nvmlGpuFabricInfo_v3_t *info) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!info)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != FABRIC_INFO_V2 && info->version != FABRIC_INFO_V3)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if ((rc = fabric_common(g, info->clusterUuid, sizeof info->clusterUuid, &info->status, &info->cliqueId,
                            &info->state)) != NVML_SUCCESS)
        return rc;
    info->healthMask = (unsigned)g->val[F_FABRIC_HEALTH_MASK];
    if (info->version == FABRIC_INFO_V3) /* v2 callers own only 36 bytes: never write the 37th */
        info->healthSummary = (unsigned char)g->val[F_FABRIC_HEALTH_SUMMARY];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t dev, unsigned int link, unsigned int *isActive) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(__func__, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    unsigned long long links = g->has[F_NVLINK_COUNT] ? g->val[F_NVLINK_COUNT] : 0;
    if (links > MAX_NVLINKS)
        links = MAX_NVLINKS;
    unsigned bound = links > NVLINK_INDEX_BOUND ? (unsigned)links : NVLINK_INDEX_BOUND;
    if (link >= bound || !isActive)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (link >= links)
        return NVML_ERROR_NOT_SUPPORTED;
    *isActive = (g->nvlink_down >> link) & 1ull ? 0u : 1u;
    return NVML_SUCCESS;
}

/* ------------------------------------------------------------------------------------ processes */

/* NVML's two-call protocol: *count too small -> INSUFFICIENT_SIZE with the needed count; no processes
 * -> SUCCESS with *count = 0 (pynvml's size query passes *count = 0 and a NULL array). */
static nvmlReturn_t list_processes(const char *function, nvmlDevice_t dev, bool compute, unsigned int *count,
                                   void *infos, bool v1_layout) {
    const struct fake_gpu *g;
    nvmlReturn_t rc = begin_device(function, dev, &g);
    if (rc != NVML_SUCCESS)
        return rc;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned n = 0;
    for (unsigned i = 0; compute && i < MAX_PROCS; i++)
        n += process_visible(&g->procs[i]);
    if (*count < n) {
        *count = n;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n > 0 && !infos)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned k = 0;
    for (unsigned i = 0; compute && i < MAX_PROCS; i++) {
        const struct process *p = &g->procs[i];
        if (k >= n)
            break; /* a live process may have appeared since it was counted: never overrun the array */
        if (!process_visible(p))
            continue;
        if (v1_layout) {
            ((nvmlProcessInfo_v1_t *)infos)[k++] = (nvmlProcessInfo_v1_t){p->pid, p->used_bytes};
        } else {
            /* not a MIG instance: NVML reports the instance ids as "not available" */
            ((nvmlProcessInfo_t *)infos)[k++] = (nvmlProcessInfo_t){
                p->pid, p->used_bytes, NVML_VALUE_NOT_AVAILABLE_UINT, NVML_VALUE_NOT_AVAILABLE_UINT};
        }
    }
    *count = k; /* ... or died: report what was filled */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_v1_t *p) {
    return list_processes(__func__, d, true, n, p, true);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *p) {
    return list_processes(__func__, d, true, n, p, false);
}
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *p) {
    return list_processes(__func__, d, true, n, p, false);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_v1_t *p) {
    return list_processes(__func__, d, false, n, p, true);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *p) {
    return list_processes(__func__, d, false, n, p, false);
}
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *n, nvmlProcessInfo_t *p) {
    return list_processes(__func__, d, false, n, p, false);
}
