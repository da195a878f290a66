"""The GPU actor's OpenCL device: a context and queue (make_context), the pool's arena as one
buffer (wrap_arena: zero-copy where memory is shared, else a copy), the kernels' tuning macros per
device kind; and pyopencl with PoCL able to compile kernels for this CPU (below).

The PoCL that PyPI's pyopencl wheels carry (pocl-binary-distribution 3.0) has LLVM 14 built in.
LLVM 14 does not know AMD's family-26 CPUs (Zen 5). It names such a host "generic", and PoCL 3.0
passes that name on as the target CPU. Clang then refuses every kernel: "unknown target CPU
'generic'" (pocl issue #1049). Newer PoCL reads POCL_LLVM_CPU_NAME for this case; 3.0 does not,
and PyPI has no newer PoCL. An Intel CPU newer than LLVM 14's table (Emerald or Granite Rapids)
it does not refuse but guesses from its features, "icelake-client", for which the same kernels
compile ~1.9x slower than for "icelake-server".

On such a CPU, socllm uses a copy of that exact library (checked by size and sha256) in which
`llvm::sys::getHostCPUName` returns a CPU that LLVM 14 knows and whose features the host has:
"icelake-server" where the host has its AVX-512 set (VNNI among them: the int8 dot products of
actors/gpu/cl/decode.cl and batch.cl take one vpdpbusd instead of two instructions), else "znver3"
(AVX2, FMA, F16C, BMI2). A Zen 4, which LLVM 14 does name, as znver3 (AVX2 only, no AVX-512),
gets "icelake-server" too; a Zen 3 (no AVX-512) keeps LLVM's znver3. The config's pocl_cpu
(SOCLLM_POCL_CPU) names one of them instead; pocl_as_is
(SOCLLM_POCL_AS_IS=1) leaves PoCL as it is. The copy is kept under ~/.cache/socllm, beside a link
to PoCL's own resources, which PoCL finds relative to its library. pyopencl's ICD loader is
pointed at it (PYOPENCL_HOME) by `name_the_cpu`, which make_context calls before the
first platform query. On any other CPU, or with another PoCL build, nothing changes.
"""
from __future__ import annotations

import hashlib
import os
import re
import struct

import numpy as np
import pyopencl as cl
import pyopencl.invoker


def _invokers_kept():
    """pyopencl gives every new kernel object (cl.Kernel, and each clone) its Python invoker
    through an on-disk cache with no layer in memory (`in_mem_cache_size=0`: a sqlite query, an
    unpickle and a compile, ~0.2 ms a kernel). The GPU actor clones a kernel for each launch it
    records (gpu/launches.py: 575 for each row count of a 16-row decode batch), so the service's
    warm-up spent ~1.8 s there on 2 cores. The same key gives the same two functions, whatever
    the kernel: kept here in memory, by pyopencl's own key (its devices only warn)."""
    import inspect
    made = pyopencl.invoker.generate_enqueue_and_set_args
    if getattr(made, "kept", None) is not None or list(inspect.signature(made).parameters) != [
            "function_name", "num_passed_args", "num_cl_args", "arg_types",
            "work_around_arg_count_bug", "warn_about_arg_count_bug", "devs"]:
        return                          # kept already, or a pyopencl this was not written for
    kept: dict = {}

    def generate_enqueue_and_set_args(function_name, num_passed_args, num_cl_args, arg_types,
                                      work_around_arg_count_bug, warn_about_arg_count_bug, devs):
        key = (function_name, num_passed_args, num_cl_args, arg_types,
               work_around_arg_count_bug, warn_about_arg_count_bug)
        try:
            got = kept.get(key)
        except TypeError:               # an argument type that does not hash: as pyopencl does
            key, got = None, None
        if got is None:
            got = made(function_name, num_passed_args, num_cl_args, arg_types,
                       work_around_arg_count_bug, warn_about_arg_count_bug, devs)
            if key is not None:
                kept[key] = got
        return got

    generate_enqueue_and_set_args.kept = kept
    pyopencl.invoker.generate_enqueue_and_set_args = generate_enqueue_and_set_args


_invokers_kept()


def _no_include_path():
    """pyopencl adds `-I <its own cl/ folder>` to every build's options, and PoCL keys its kernel
    cache by source and options: a new venv or a fresh clone (another folder) compiled every
    kernel again, ~0.5 s a build on 2 cores (~2 min of the suite's CPU in a fresh clone). socllm's
    kernels include nothing: that option is dropped, for every build in the process."""
    opts = getattr(cl, "_DEFAULT_INCLUDE_OPTIONS", None)
    if isinstance(opts, list) and len(opts) == 2 and opts[0] == "-I":
        opts.clear()


_no_include_path()

# libpocl of pocl-binary-distribution 3.0 in pyopencl 2026.1.4's wheel:
# sha256 -> (getHostCPUName's offset, {CPU name: offset of that string}), from its symbol table
KNOWN = {"d214aece60df73c75d8a678d33e4a51f4e5b594772dc74891b5451f909db6025":
         (0x42E6BC0, {"znver3": 0x435DFDE, "icelake-server": 0x435DFF0})}
# the CPUs socllm may name, best first, with the host flags each needs (/proc/cpuinfo's names)
TARGETS = {"icelake-server": {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512ifma",
                              "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
                              "avx512_vpopcntdq", "gfni", "vaes", "vpclmulqdq", "avx2", "fma",
                              "f16c", "bmi2"},
           "znver3": {"avx2", "fma", "f16c", "bmi2"}}
LLVM14_AMD_FAMILY_MAX = 25        # Zen 3 / 4: the newest AMD family LLVM 14 names
# Intel family 6: LLVM 14 names models up to Sapphire Rapids (0x8f) and, past it, Alder Lake (0x97,
# 0x9a) and Rocket Lake (0xa7). A newer one (Emerald Rapids 0xcf, Granite Rapids 0xad / 0xae) it
# guesses from its features: "icelake-client" for an AVX-512 server, whose kernels ran 1.9x slower
# than the same PoCL naming "icelake-server" (a 16-row decode step 89 ms against 47-61 on a 2-core
# Emerald Rapids VM, profile_decode; the f32 LM head 34-37 ms against 7.3-7.5)
LLVM14_INTEL_LAST = 0x8f
LLVM14_INTEL_LATER = {0x97, 0x9a, 0xa7}


def _cpu() -> dict:
    try:
        text = open("/proc/cpuinfo").read().split("\n\n")[0]
    except OSError:
        return {}
    return dict((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in text.splitlines()))


def named_cpu(info: dict | None = None, asked: str | None = None) -> str | None:
    """For a CPU that LLVM 14 cannot name (a newer AMD or Intel one) or names below its features
    (a Zen 4): the best of TARGETS whose features it has (or `asked`, the config's pocl_cpu, if
    it has those); None for any other CPU."""
    info = _cpu() if info is None else info
    flags = set(info.get("flags", "").split())
    try:
        family = int(info.get("cpu family", "0"))
    except ValueError:
        return None
    if not (_unnamed(info.get("vendor_id"), family, info.get("model", "0"))
            or _named_below(info.get("vendor_id"), family, flags)):
        return None
    # an Intel CPU without AVX-512 (Raptor Lake) is left to LLVM 14's guess, not given AMD's znver3
    fits = [cpu for cpu, needs in TARGETS.items() if needs <= flags
            and (cpu != "znver3" or info.get("vendor_id") == "AuthenticAMD")]
    if asked and asked not in fits:
        import sys
        print(f"socllm: SOCLLM_POCL_CPU={asked!r} is not one of this CPU's targets "
              f"({', '.join(fits) or 'none'}); using {fits[0] if fits else 'PoCL as it is'}",
              file=sys.stderr)
    elif asked:
        return asked
    return fits[0] if fits else None


def _named_below(vendor: str | None, family: int, flags: set) -> bool:
    """Whether LLVM 14 names this CPU below its features: a Zen 4 (AMD family 25 with AVX-512) it
    calls znver3, AVX2 only, where "icelake-server" compiles the same kernels to AVX-512 and VNNI
    (a 16-row q16 decode step 36 -> 30 ms, 4 rows 18 -> 12 on a 2-core Zen 4, profile_decode)."""
    return (vendor == "AuthenticAMD" and family == LLVM14_AMD_FAMILY_MAX
            and TARGETS["icelake-server"] <= flags)


def _unnamed(vendor: str | None, family: int, model: str) -> bool:
    """Whether LLVM 14 has no name for this CPU (and guesses, or says "generic")."""
    if vendor == "AuthenticAMD":
        return family > LLVM14_AMD_FAMILY_MAX
    if vendor != "GenuineIntel" or family != 6:
        return False
    try:
        m = int(model)
    except ValueError:
        return False
    return m > LLVM14_INTEL_LAST and m not in LLVM14_INTEL_LATER


def _patched(lib: str, cache: str, cpu: str) -> str | None:
    """The copy of `lib` that names `cpu`, made once; None for an unknown build."""
    st = os.stat(lib)
    stamp = f"{lib} {st.st_size} {st.st_mtime_ns}"
    home = os.path.join(cache, "pyopencl-" + cpu)
    old = os.path.join(cache, "pyopencl")             # the copy's place before there were targets
    if os.path.isdir(old):
        import shutil
        shutil.rmtree(old, ignore_errors=True)
    out = os.path.join(home, ".libs", "libpocl-" + cpu + ".so")
    marker = out + ".source"
    if os.path.exists(out) and os.path.exists(marker) and open(marker).read() == stamp:
        return home
    _prune(os.path.dirname(cache))
    data = bytearray(open(lib, "rb").read())
    at = KNOWN.get(hashlib.sha256(data).hexdigest())
    if at is None:
        return None
    fn, name = at[0], at[1][cpu]
    CPU = cpu.encode()
    if data[name: name + len(CPU) + 1] != CPU + b"\0":
        return None
    # lea rax, [rip + name]; mov edx, len; ret: a StringRef (pointer, length) in rax:rdx
    code = b"\x48\x8d\x05" + struct.pack("<i", name - (fn + 7)) + b"\xba" + struct.pack("<I", len(CPU)) + b"\xc3"
    data[fn: fn + len(code)] = code
    os.makedirs(os.path.dirname(out), exist_ok=True)
    link = os.path.join(cache, "pocl_binary_distribution")   # $ORIGIN/../../ in its RPATH
    real = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(lib))), "pocl_binary_distribution")
    if os.path.realpath(link) != os.path.realpath(real):
        tmp = f"{link}.{os.getpid()}"
        os.symlink(real, tmp)
        os.replace(tmp, link)
    for path, content in ((out, bytes(data)), (os.path.join(home, ".libs", "pocl.icd"), (out + "\n").encode()),
                          (marker, stamp.encode())):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(content)
        os.replace(tmp, path)               # several actors may start at once
    return home


def _prune(root: str):
    """Removes the copies made for installs since deleted (a venv or a clone gone: their link to
    its PoCL resources dangles), ~104 MB each; called when a new copy is made."""
    import shutil
    for d in os.listdir(root) if os.path.isdir(root) else ():
        link = os.path.join(root, d, "pocl_binary_distribution")
        if os.path.islink(link) and not os.path.exists(link):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


_named = False


def name_the_cpu(config=None):
    """Point pyopencl's loader at the copy of PoCL that names this CPU, as `config`
    (policies/config.py EngineConfig; None: EngineConfig.from_env()) asks: once per process,
    before its first platform query (later calls change nothing)."""
    global _named
    if _named:
        return
    _named = True
    if config is None:
        from socllm.policies.config import EngineConfig
        config = EngineConfig.from_env()
    cpu = None if config.pocl_as_is else named_cpu(asked=config.pocl_cpu)
    if cpu is None:
        return
    libs = os.path.join(os.path.dirname(cl.__file__), ".libs")
    found = [f for f in os.listdir(libs) if f.startswith("libpocl")] if os.path.isdir(libs) else []
    if len(found) != 1:
        return
    lib = os.path.realpath(os.path.join(libs, found[0]))
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "socllm", "pocl", hashlib.sha1(lib.encode()).hexdigest()[:12])   # per install
    try:
        home = _patched(lib, cache, cpu)
    except OSError:
        return
    if home:
        os.environ["PYOPENCL_HOME"] = home    # read by the loader at its first platform query


# tuning macros of kernels.cl: a GPU splits a GEMV row over a warp and an attention row's keys over
# a work-group (split-K); PoCL-on-CPU runs a work-group on one thread, so a work-item gets whole
# rows (LIN_R rows a group; 16 measured worse than 8 on 2 threads) and vectorizes inside them
_KNOBS = {"gpu": {"LIN_T": 32, "LIN_R": 4, "GEMM_TN": 4, "ATT_WG": 64},
          "cpu": {"LIN_T": 1, "LIN_R": 8, "GEMM_TN": 8, "ATT_WG": 1}}
# a GPU's work shapes, small enough for PoCL: the tests build the GPU forms of the kernels with
# these options (a GEMV row pair over LIN_T work-items, epilogues over the last work-group,
# attention over ATT_WG), so those forms run on this machine too
GPU_SHAPED = "-DSOCLLM_PORTABLE -DLIN_T=8 -DLIN_R=2 -DATT_WG=4"
_KNOB = re.compile(r"-D\s*(LIN_T|LIN_R|GEMM_TN|ATT_WG)=(\d+)")


def tuning(device, build_options: str = "") -> tuple:
    """-> (knobs, compiler options): the device kind's _KNOBS, overridden by -DKNOB=n in
    build_options, followed by build_options' other flags."""
    knobs = dict(_KNOBS["gpu" if device.type & cl.device_type.GPU else "cpu"])
    knobs.update({k: int(v) for k, v in _KNOB.findall(build_options)})
    options = " ".join([f"-D{k}={v}" for k, v in knobs.items()] + [_KNOB.sub("", build_options).strip()])
    return knobs, options


def make_context(device_kind: str = "any", profile: bool = False, config=None):
    """-> (ctx, queue, device). "any": the first GPU of any platform, else a CPU device (PoCL's
    first); "gpu" / "cpu": only that kind, RuntimeError if there is none. profile: a queue that
    times every kernel (CLKernels.kernel_times). config: the PoCL knobs of this process's first
    context (opencl.name_the_cpu; None: the environment's)."""
    name_the_cpu(config)
    gpus, cpus = [], []
    for p in cl.get_platforms():
        for d in p.get_devices():
            if d.type & cl.device_type.GPU:
                gpus.append(d)
            elif d.type & cl.device_type.CPU:
                cpus.append(d)
    cpus.sort(key=lambda d: "Portable Computing Language" not in d.platform.name)
    pick = {"any": gpus + cpus, "gpu": gpus, "cpu": cpus}[device_kind]
    if not pick:
        raise RuntimeError(f"no OpenCL {device_kind} device")
    device = pick[0]
    ctx = cl.Context([device])
    props = cl.command_queue_properties.PROFILING_ENABLE if profile else 0
    return ctx, cl.CommandQueue(ctx, device, properties=props), device


def discrete(ctx: cl.Context, forced: bool | None = None) -> bool:
    """Device memory apart from the host's (a discrete GPU), or `forced` (the config's
    cl_discrete, SOCLLM_CL_DISCRETE=1; None: the environment's): the copying path on a unified
    device (PoCL), to test it where no discrete GPU is."""
    if forced is None:
        from socllm.policies.config import EngineConfig
        forced = EngineConfig.from_env().cl_discrete
    return forced or not all(d.host_unified_memory for d in ctx.devices)


def wrap_arena(ctx: cl.Context, arena: np.ndarray, forced: bool | None = None) -> cl.Buffer:
    """The arena (uint8 [bytes]) as one cl.Buffer: zero-copy (USE_HOST_PTR) on host-unified memory,
    else an uploaded copy (COPY_HOST_PTR), whose outputs the caller must copy back. forced:
    discrete()'s."""
    mf = cl.mem_flags
    if not discrete(ctx, forced):
        if arena.ctypes.data % 64:   # PoCL uses the pointer as is: a misaligned vector load faults
            raise ValueError("the arena must start 64-byte aligned to be wrapped zero-copy")
        return cl.Buffer(ctx, mf.READ_WRITE | mf.USE_HOST_PTR, hostbuf=arena)
    return cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=arena)


class Mirror:
    """A host arena and a discrete buffer holding its copy, kept whole in step: the host's is
    uploaded before the first launch after a finish() (the caller may have written it), and the
    device's downloaded by finish(). The kernel tests' harness on a discrete device; the engine
    copies only live ranges."""

    def __init__(self, host: np.ndarray):
        self.host, self.stale = host, True
