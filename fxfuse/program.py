"""The program IR of the fused op, and its reference interpreter.

Entry points: ``Program`` (``Program.parse(text)``, ``str(program)``), ``run_program`` (the program on a given
GEMM output) and ``run_reference`` (the GEMM, then the program).

A program is a straight-line list of epilogue instructions in SSA form, serialized as text such as

    add(%0,$0);clamp(%1,-1.0,1.0);mish(%2);group_norm(%3,$1,$2,256,1e-05)

- ``%0`` is the GEMM output ``linear(x, weight, bias)``; instruction ``i`` (from 0) defines ``%{i+1}``.
- ``$k`` is ``params[k]``, a tensor from outside the region (a parameter, buffer, graph input...). An instruction may
  read params and numbers only (``mul($0,2.0)``: eager's ``alpha * b`` before its add); the rewritten graph computes
  those before the fused op (``hoist_param_steps``), as the kernels bind none such.
- Every other token is a literal: a Python number (``inf``/``nan`` included), ``None``, ``True``/``False``
  or a quoted string such as ``'tanh'``.
- Each instruction lists its operands, then its attributes, in the order of its reference's signature
  (``fxfuse.epilogue``). The last instruction's value is the op's result.
- An op name with a trailing ``_`` (``add_(%1,$0)``) is the model's in-place op: its value keeps the dtype of its
  first operand, the value (``%i``) it changed, as torch's in-place ops do (under autocast a 16-bit value plus a float32
  param would otherwise promote). The kernels compute in one dtype, where it is the op itself.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence, Union

import torch
import torch.nn.functional as F

from .epilogue import EPILOGUE_OPS


@dataclass(frozen=True)
class Value:
    index: int

    def __str__(self):
        return f"%{self.index}"


@dataclass(frozen=True)
class Param:
    index: int

    def __str__(self):
        return f"${self.index}"


Operand = Union[Value, Param, int, float, bool, str, None]


def format_literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value + "'"
    if isinstance(value, float):
        return repr(float(value))  # round-trips exactly; 'inf', '-inf' and 'nan' included (NumPy's floats as Python's)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(int(value))
    return str(value)


def parse_token(token: str) -> Operand:
    if token.startswith("%"):
        return Value(int(token[1:]))
    if token.startswith("$"):
        return Param(int(token[1:]))
    if token.startswith("'") and token.endswith("'"):
        return token[1:-1]
    if token in ("None", "True", "False"):
        return {"None": None, "True": True, "False": False}[token]
    try:
        return int(token)
    except ValueError:
        return float(token)


IN_PLACE = "_"  # the suffix of an in-place instruction's op name


@dataclass(frozen=True)
class Instruction:
    op: str
    operands: tuple[Operand, ...]
    attrs: tuple[Any, ...]
    in_place: bool = False  # the value keeps its first operand's dtype

    def __str__(self):
        items = [str(o) if isinstance(o, (Value, Param)) else format_literal(o) for o in self.operands]
        items += [format_literal(a) for a in self.attrs]
        return f"{self.op}{IN_PLACE if self.in_place else ''}({','.join(items)})"

    @property
    def attr_dict(self) -> dict[str, Any]:
        return dict(zip(EPILOGUE_OPS[self.op].attrs, self.attrs))


@dataclass(frozen=True)
class Program:
    instructions: tuple[Instruction, ...]

    def __str__(self):
        return ";".join(str(i) for i in self.instructions)

    @staticmethod
    @functools.lru_cache(maxsize=4096)
    def parse(text: str) -> "Program":
        instructions = []
        for item in filter(None, (s.strip() for s in text.split(";"))):
            name, _, rest = item.partition("(")
            in_place = name.endswith(IN_PLACE) and name[:-len(IN_PLACE)] in EPILOGUE_OPS
            if in_place:
                name = name[:-len(IN_PLACE)]
            if name not in EPILOGUE_OPS or not rest.endswith(")"):
                raise ValueError(f"fxfuse: bad program instruction {item!r}")
            spec = EPILOGUE_OPS[name]
            tokens = [parse_token(t.strip()) for t in rest[:-1].split(",")] if rest[:-1].strip() else []
            if len(tokens) != len(spec.operands) + len(spec.attrs):
                raise ValueError(f"fxfuse: {name} takes {len(spec.operands)} operands and "
                                 f"{len(spec.attrs)} attributes, got {item!r}")
            n = len(spec.operands)
            for operand in tokens[:n]:
                if isinstance(operand, Value) and operand.index > len(instructions):
                    raise ValueError(f"fxfuse: {item!r} reads %{operand.index} before it is defined")
            if in_place and not (n and isinstance(tokens[0], Value)):
                raise ValueError(f"fxfuse: in-place {item!r} changes no value of the program (its first operand)")
            instructions.append(Instruction(name, tuple(tokens[:n]), tuple(tokens[n:]), in_place))
        return Program(tuple(instructions))


def run_program(y: torch.Tensor, params: Sequence[torch.Tensor], program: str) -> torch.Tensor:
    """Interpret ``program`` on the GEMM output ``y`` (``%0``) with each op's plain-PyTorch reference, in eager's
    op order, on any device."""
    values = [y]
    for instruction in Program.parse(program).instructions:
        args = []
        for operand in instruction.operands:
            if isinstance(operand, Value):
                args.append(values[operand.index])
            elif isinstance(operand, Param):
                args.append(params[operand.index])
            else:
                args.append(operand)
        value = EPILOGUE_OPS[instruction.op].reference(*args, **instruction.attr_dict)
        values.append(value.to(args[0].dtype) if instruction.in_place else value)
    return values[-1]


def run_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  params: Sequence[torch.Tensor], program: str) -> torch.Tensor:
    """``linear(x, weight, bias)``, then ``program`` on it (``run_program``)."""
    return run_program(F.linear(x, weight, bias), params, program)


def hoist_param_steps(program: Program, n_params: int) -> tuple[Program, list[Instruction]]:
    """``program`` without its instructions that read no value, only params and numbers (``mul($0,2.0)``): each is a
    new param instead, ``$n_params`` on, for the caller to compute before the fused op. Returns that program and the
    taken instructions in the new params' order, each on the params before its own. The program's result stays its
    own instruction."""
    renamed: dict[int, Operand] = {0: Value(0)}  # a value's index in `program` -> what stands for it now
    kept: list[Instruction] = []
    taken: list[Instruction] = []
    for index, instruction in enumerate(program.instructions, start=1):
        operands = tuple(renamed[o.index] if isinstance(o, Value) else o for o in instruction.operands)
        instruction = Instruction(instruction.op, operands, instruction.attrs, instruction.in_place)
        if index < len(program.instructions) and not any(isinstance(o, Value) for o in operands):
            taken.append(instruction)
            renamed[index] = Param(n_params + len(taken) - 1)
        else:
            kept.append(instruction)
            renamed[index] = Value(len(kept))
    return Program(tuple(kept)), taken


def drop_unread_params(program: Program, params: list) -> tuple[Program, list]:
    """``program`` and ``params`` without the params no instruction reads (those only hoisted steps read), the rest
    renumbered in order."""
    read = sorted({o.index for i in program.instructions for o in i.operands if isinstance(o, Param)})
    new_index = {old: new for new, old in enumerate(read)}
    instructions = tuple(
        Instruction(i.op, tuple(Param(new_index[o.index]) if isinstance(o, Param) else o for o in i.operands), i.attrs,
                    i.in_place) for i in program.instructions)
    return Program(instructions), [params[k] for k in read]
