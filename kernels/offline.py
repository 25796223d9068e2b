"""Compiling the kernels offline, for GPUs this machine does not have (no GPU needed), and reading
what the compiler made of them: the launch signature as Triton's launcher specializes it, the main
loop's opcodes in PTX or SASS, ptxas's register and spill report. Used by
:mod:`fp4video.kernels.report`, the offline tests and the lab tools."""

from __future__ import annotations

import collections
import os
import re
import subprocess

#: the integer arguments of a Wan-480p launch (B = 1, H = 40, S = 32,760, D = 128; K̂/V̂ᵀ padded to
#: 32,768 keys; the key mask (B, S)), by name across the loop kernels
_S, _SP = 32760, 32768
WAN_480P_INTS = dict(H=40, SQ=_S, SK=_S, SK_PAD=_SP, DV=128, DQK=128, sqb=40 * _S * 128, sqh=_S * 128, sqs=128, sqd=1,
                     skb=40 * _SP * 128, skh=_SP * 128, sks=128, skd=1, svb=40 * 128 * _SP, svh=128 * _SP, svs=128,
                     svd=_SP, smb=_S, sms=1, sob=40 * _S * 128, soh=_S * 128, sos=128, sod=1, slb=40 * _S, slh=_S, sls=1,
                     svsd=128)


def tool_path(name: str) -> str:
    """A CUDA tool Triton ships (``nvdisasm``, ``ptxas``, ``ptxas-blackwell``, ``cuobjdump``)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


#: the elements of the loop kernels' grouped (tuple) arguments, by argument name across the
#: kernels (the dot_scaled loops', :mod:`.loop_scaled`): :func:`launch_signature` takes their types
#: and integers by these names
GROUPED_ARGUMENTS = {"q_ptrs": ("Q4", "QS"), "g_ptrs": ("GQK", "GV"), "out_ptrs": ("Out", "Lse"),
                     "sizes": ("H", "SQ", "SK", "SK_PAD", "DV"), "strides_q": ("sqb", "sqh", "sqs"),
                     "strides_k": ("skb", "skh", "sks"), "strides_v": ("svb", "svh", "svd", "svsd"),
                     "strides_m": ("smb", "sms"), "strides_o": ("sob", "soh", "sos", "sod"),
                     "strides_lse": ("slb", "slh", "sls"), "lists": ("KIdx", "KCnt", "NQT", "NKT")}


def launch_signature(fn, consts: dict, ptr: dict, ints: dict, floats=()):
    """(signature, constexprs, attributes) for ``ASTSource`` as Triton's launcher specializes a
    launch of ``fn`` with these integer arguments: one equal to 1 becomes the constant 1, a
    multiple of 16 is marked 16-divisible, as is every pointer (torch aligns its allocations);
    ``ptr``: the types of the pointer (or descriptor) arguments, ``floats``: the fp32 ones. A
    grouped argument (:data:`GROUPED_ARGUMENTS`) is specialized element by element, each element
    typed and valued by its own name, as the launcher does with a tuple.
    (Compiled without this, unit strides stay runtime values and loads and stores go scalar.)"""
    names = fn.arg_names
    unknown = sorted(set(consts) - set(names))
    if unknown:
        raise ValueError(f"constexprs {unknown} are not arguments of {fn.__name__}")
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        group = GROUPED_ARGUMENTS.get(name) if name not in consts else None
        leaves = [((i,), name)] if group is None else [((i, j), e) for j, e in enumerate(group)]
        types = []
        for path, e in leaves:
            if e in consts or ints.get(e) == 1:
                constexprs[path] = consts.get(e, 1)
                types.append("constexpr")
                continue
            ty = ptr.get(e, "fp32" if e in floats else "i32")
            if ty.startswith("*") or (ty == "i32" and e in ints and ints[e] % 16 == 0):
                attrs[path] = [["tt.divisibility", 16]]
            types.append(ty)
        sig[name] = types[0] if group is None else tuple(types)
    return sig, constexprs, attrs


def compile_kernel(fn, consts: dict, ptr: dict, ints: dict, *, arch: int = 90, floats=(), gluon: bool = False,
                   **options):
    """``fn`` compiled for ``sm_{arch}`` with these constexprs, pointer types and integer arguments
    (:func:`launch_signature`), Triton's options (``num_warps``, ``num_stages``, ``maxnreg``, ...)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        from triton.compiler import ASTSource as source
    names = fn.arg_names
    missing = [names[i] for i in fn.constexprs if names[i] not in consts]
    if missing:  # every constexpr must be fixed, or Triton makes it a runtime argument
        raise ValueError(f"constexpr arguments not set: {missing}")
    sig, constexprs, attrs = launch_signature(fn, consts, ptr, ints, floats)
    return triton.compile(source(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                          options=options)


def _loops(lines, label_re, branch_re, op_re, conditional_re):
    """Every loop of an assembly listing, as (start line, end line, opcode counts): a label and a
    conditional backward branch to it (an unconditional one jumps back from out-of-line code, e.g.
    an mbarrier wait's retry, into the middle of the kernel), one per latch."""
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(label_re, line.strip())
        if m:
            labels[m.group(1)] = i
        m = re.search(branch_re, line)
        if m and labels.get(m.group(1), i) < i and re.match(conditional_re, line):
            ops = collections.Counter()
            for body_line in lines[labels[m.group(1)]:i + 1]:
                mm = re.match(op_re, body_line)
                if mm:
                    ops[mm.group(1)] += 1
            yield labels[m.group(1)], i + 1, ops


def loop_opcodes(lines, label_re, branch_re, op_re, is_mma, conditional_re=r"\s*(?:/\*[0-9a-f]+\*/\s+)?@",
                 most: bool = False):
    """Opcode counts and lines of the innermost loop (label ... backward branch to it, the shortest
    such span) that issues MMAs: the main loop (the tail tile is not a loop); in the Gluon kernel,
    one warpgroup's (the partitions' loops are alike). ``most``: instead the loop with the most
    opcodes ``is_mma`` accepts (a warp-specialized kernel's softmax loop, by its exp2s: its
    correction partition also has a few)."""
    best, body, best_hits = None, [], 0
    for start, end, ops in _loops(lines, label_re, branch_re, op_re, conditional_re):
        span = end - start
        hits = sum(n for op, n in ops.items() if is_mma(op))
        if hits and (best is None or (hits > best_hits or (hits == best_hits and span < len(body)) if most
                                      else span < len(body))):
            best, body, best_hits = ops, lines[start:end], hits
    if best is None:
        raise SystemExit("error: no loop with the opcodes asked for (by default MMAs) found")
    return best, body


#: how a SASS listing (nvdisasm -c) spells a label, a branch, an opcode and a loop's latch: a
#: predicated branch (@P0 BRA), or Blackwell's uniform one (BRA.U UP0, target)
_SASS_SYNTAX = dict(label_re=r"^(\.L_x_\d+):", branch_re=r"BRA(?:\.U)?\s+(?:!?UP\w+,\s*)?`?\(?(\.L_x_\d+)",
                    op_re=r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                    conditional_re=r"\s*(?:/\*[0-9a-f]+\*/\s+)?(?:@|BRA\.U\s+!?UP)")


def sass_lines(kernel, nvdisasm: str, tmp: str) -> list[str]:
    """A compiled kernel's SASS, disassembled by ``nvdisasm``, line by line."""
    path = os.path.join(tmp, "loop.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout.splitlines()


def sass_mma_loop(kernel, nvdisasm: str, tmp: str, is_loop_op=lambda op: "MMA" in op, most: bool = False,
                  lines: list[str] | None = None):
    """:func:`loop_opcodes` of a compiled kernel's SASS (disassembled by ``nvdisasm``, unless its
    :func:`sass_lines` are given): the innermost loop issuing MMAs (Hopper's warpgroup MMAs,
    Blackwell's tcgen05 / mma.sync ones), or the innermost one with an opcode ``is_loop_op`` accepts
    (a warp-specialized kernel's softmax loop: ``MUFU``)."""
    s = _SASS_SYNTAX
    lines = sass_lines(kernel, nvdisasm, tmp) if lines is None else lines
    return loop_opcodes(lines, s["label_re"], s["branch_re"], s["op_re"], is_loop_op,
                        conditional_re=s["conditional_re"], most=most)


#: SASS opcodes that mark a partition's role: tcgen05 MMA issue, TMA copies into shared memory
_SASS_MMA = re.compile(r"^UTC\w*MMA")
_SASS_TMA = re.compile(r"^(UTMALDG|UBLKCP)")


def sass_loops(lines: list[str], min_instructions: int = 10) -> list[collections.Counter]:
    """The opcode counts of every loop of a kernel's SASS (:func:`sass_lines`; :func:`_loops`, per
    label its shortest span) that waits on or arrives at an mbarrier (``SYNCS``) and has at least
    ``min_instructions``: in a warp-specialized kernel, each partition's key loop. (The retry loops of an mbarrier wait are
    out of line, those of the tensor-memory allocation and of the register reallocation hold no
    mbarrier operation.)"""
    loops = {}
    for start, _, ops in _loops(lines, **_SASS_SYNTAX):
        if any(op.startswith("SYNCS") for op in ops) and sum(ops.values()) >= min_instructions:
            loops.setdefault(start, ops)  # a label's first latch: its shortest span
    return list(loops.values())


def loop_role(ops: collections.Counter) -> str:
    """``mma`` (issues tcgen05 MMAs), ``tma`` (issues TMA copies) or ``vector`` (the rest: softmax,
    row statistics, the accumulator's correction) of one loop's SASS opcodes."""
    if any(_SASS_MMA.match(op) for op in ops):
        return "mma"
    if any(_SASS_TMA.match(op) for op in ops):
        return "tma"
    return "vector"


def ttgir_partitions(ttgir: str, default_warps: int) -> list[tuple[str, int]]:
    """(role, warps) of each partition of a warp-specialized loop's TTGIR that runs a key loop, the
    default partition first: ``mma`` where its loop holds a tcgen05 MMA, ``tma`` where it holds a
    TMA copy (and no MMA), else ``vector``. Empty if the TTGIR has no ``ttg.warp_specialize``."""
    heads = [(m.start(), m.group(1)) for m in re.finditer(r"^\s*(default) \{|^\s*partition\d+\(", ttgir, re.M)]
    parts = []
    for n, (start, is_default) in enumerate(heads):
        stop = heads[n + 1][0] if n + 1 < len(heads) else len(ttgir)
        end = re.compile(r"tt\.warp_specialize\}").search(ttgir, start, stop)  # the end of this partition's key loop
        body = ttgir[start:end.start() if end else stop]
        loop = body[body.find("scf.for"):] if "scf.for" in body else ""
        ops = re.findall(r"(?:=|^)\s*([a-z_]+\.[\w.]+)", loop.split("\n", 1)[-1], re.M)
        if not any(not op.startswith("arith.") and op != "scf.yield" for op in ops):
            continue  # (a partition with nothing to do in the loop, e.g. a default whose loop only counts its phase)
        head_end = ttgir.find("\n", start)
        warps = default_warps if is_default else int(re.search(r"num_warps\((\d+)\)", ttgir[start:head_end]).group(1))
        role = "mma" if "tc_gen5_mma" in body else "tma" if "async_tma_copy_global_to_local" in body else "vector"
        parts.append((role, warps))
    return parts


def partition_issue(loops: list[collections.Counter], parts: list[tuple[str, int]]):
    """Each SASS key loop matched to the partition that runs it, by role (the MMA-issuing loop to
    the MMA partition, the TMA-issuing one to the load partition, the others to the vector
    partitions): a list of (role, warps, opcodes), or None where the loops and the partitions do
    not pair up (different counts per role), or where vector partitions of different sizes leave
    the pairing open."""
    by_role = collections.defaultdict(list)
    for role, warps in parts:
        by_role[role].append(warps)
    loop_roles = collections.Counter(loop_role(ops) for ops in loops)
    if any(loop_roles[r] != len(by_role[r]) for r in set(loop_roles) | set(by_role)):
        return None
    if any(len(set(w)) > 1 for w in by_role.values()):
        return None
    return [(loop_role(ops), by_role[loop_role(ops)][0], ops) for ops in loops]


def ptxas_report(ptx: str, bin_dir: str, tmp: str, arch: int = 90):
    """(registers, spill-store bytes, serialization warnings) as ``ptxas -v`` reports them for
    sm_{arch}a, from the first of Triton's ptxas that takes this PTX version; None if none does.
    C7513: ptxas finds a register hazard between asynchronous MMAs and makes them all wait; C7512:
    it has too few registers to keep them in flight, and does the same."""
    path = os.path.join(tmp, "kernel.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    for name in ("ptxas-blackwell", "ptxas"):
        exe = os.path.join(bin_dir, name)
        if not os.path.exists(exe):
            continue
        run = subprocess.run([exe, "-v", "--gpu-name", f"sm_{arch}a", path, "-o", os.path.join(tmp, "kernel.o")],
                             capture_output=True, text=True)
        text = run.stderr + run.stdout
        regs, spills = re.search(r"Used (\d+) registers", text), re.search(r"(\d+) bytes spill stores", text)
        if run.returncode == 0 and regs:
            codes = [c for c in ("C7512", "C7513") if c in text]
            return int(regs.group(1)), int(spills.group(1)) if spills else 0, codes
    return None
