# The SASS of one kernel of kernels/src/cuda/ops.cu, read on a machine without a GPU
# (docs/PERF.md, thirty-seventh session): where ptxas put the warpgroup MMAs, their waits
# and the exponentials, and the registers and spills it reports. For checking a kernel's
# schedule before spending device time on timing it.
#   python3 tools/gpu-lab/sass.py flash_attn_pp_f16_d128 [--src kernels/src/cuda/ops.cu]
#       [--arch sm_90a] [--full]
# It fetches NVRTC, ptxas, cuobjdump and nvdisasm from PyPI once (nvidia-cuda-nvrtc-cu12,
# nvidia-cuda-nvcc-cu12, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm; about 60 MB) into
# $DISAGG_CACHE/cuda-tools (default ~/.cache/disagg/cuda-tools), compiles the source as
# the engine does at start (NVRTC, the GPU's arch and nothing else), and prints the
# kernel's listing with each run of MUFU.EX2 and of HGMMA counted as one line. The GPU
# machine compiles with its own NVRTC (CUDA 13.0), whose schedule may differ from this
# one's (12.9): confirm there what matters.
import argparse, ctypes, glob, os, re, subprocess, sys, zipfile

PACKAGES = ["nvidia-cuda-nvrtc-cu12", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"]
EVENTS = re.compile(r"HGMMA|DEPBAR|MUFU\.EX2|SYNCS|BAR\.|BRA|FENCE|MEMBAR|EXIT")


def tools_dir():
    d = os.path.join(os.environ.get("DISAGG_CACHE", os.path.expanduser("~/.cache/disagg")), "cuda-tools")
    done = os.path.join(d, ".complete")
    if not os.path.exists(done):
        os.makedirs(d, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", d, *PACKAGES], check=True)
        for w in glob.glob(os.path.join(d, "*.whl")):
            zipfile.ZipFile(w).extractall(d)
            os.remove(w)
        for f in glob.glob(os.path.join(d, "**/bin/*"), recursive=True):
            os.chmod(f, 0o755)
        open(done, "w").close()
    return d


def find(d, pattern):
    hits = sorted(glob.glob(os.path.join(d, "**", pattern), recursive=True))
    if not hits:
        sys.exit(f"{pattern} not found under {d}: remove the folder to fetch the tools again")
    return hits[0]


def nvrtc_ptx(d, src, arch):
    lib = ctypes.CDLL(find(d, "libnvrtc.so.*[0-9]"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), open(src, "rb").read(), b"ops.cu", 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"--ptxas-options=-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
    ptx = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value, log.value.decode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernel")
    ap.add_argument("--src", default=os.path.join(os.path.dirname(__file__), "../../kernels/src/cuda/ops.cu"))
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--full", action="store_true", help="the whole SASS listing")
    a = ap.parse_args()
    d = tools_dir()
    ptx, log = nvrtc_ptx(d, a.src, a.arch)
    # ptxas' report for this kernel: registers, spills, and its performance remarks.
    lines = log.splitlines()
    for i, l in enumerate(lines):
        if f"entry function '{a.kernel}'" in l:
            print("\n".join(x.strip() for x in lines[i + 1 : i + 4] if "Compile time" not in x))
    for l in lines:
        if re.search(r"C75\d\d", l) and a.kernel in l:
            print(l.strip())
    work = os.path.join(d, "work")
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "k.ptx"), "wb") as f:
        f.write(ptx)
    cubin = os.path.join(work, "k.cubin")
    subprocess.run([find(d, "bin/ptxas"), f"-arch={a.arch}", os.path.join(work, "k.ptx"), "-o", cubin], check=True)
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(find(d, "bin/nvdisasm")))
    sass = subprocess.run(
        [find(d, "bin/cuobjdump"), "-sass", "-fun", a.kernel, cubin], env=env, check=True, capture_output=True, text=True
    ).stdout
    run, count = None, 0
    for l in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", l)
        if not m:
            continue
        at, ins = m.groups()
        if not a.full and not EVENTS.search(ins):
            continue
        op = ins.split()[0] if not ins.startswith("@") else ins.split()[1]
        key = op if op in ("MUFU.EX2",) or op.startswith("HGMMA") else None
        if key and key == run:
            count += 1
            continue
        if run:
            print(f"        … {run} ×{count} in a row")
            run = None
        if key:
            run, count = key, 1
        print(f"  {at}  {ins}")
    if run:
        print(f"        … {run} ×{count} in a row")


main()
