"""Compiling the kernels offline, for GPUs this machine does not have (no GPU needed): the lab
tools and the tests read the PTX / SASS of the launches as the kernels' launchers specialize them."""

from __future__ import annotations


def launch_signature(fn, consts: dict, ptr: dict, ints: dict, floats=()):
    """(signature, constexprs, attributes) for ``ASTSource`` as Triton's launcher specializes a
    launch of ``fn`` with these integer arguments: one equal to 1 becomes the constant 1, a
    multiple of 16 is marked 16-divisible, as is every pointer (torch aligns its allocations);
    ``ptr``: the types of the pointer (or descriptor) arguments, ``floats``: the fp32 ones.
    (Compiled without this, unit strides stay runtime values and loads and stores go scalar.)"""
    names = fn.arg_names
    consts = {**{n: 1 for n, v in ints.items() if v == 1 and n in names}, **consts}
    sig = {n: "constexpr" if n in consts else ptr.get(n, "fp32" if n in floats else "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or (sig[n] == "i32" and n in ints and ints[n] % 16 == 0)]
    return (sig, {(names.index(k),): v for k, v in consts.items()},
            {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})


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
