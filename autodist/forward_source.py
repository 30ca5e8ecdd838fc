"""What a model's own code does with its Linear layers, read from the source of its forward methods (ast).

When torch.fx cannot trace a model, the rewriter swaps plain ``nn.Linear``
modules one by one. The swap is exact for whatever the code does with a
layer's *output*, but not for code that reads a layer's *parameters* itself
(``self.fc.weight.pow(2).sum()`` would see this rank's shard), and without a
graph the plan cannot tell which layers are fed the model's input (their
backward sends nothing). Both questions are answered here from the source of
``forward`` and of the methods it calls on ``self``, for the model and every
submodule whose class is not torch's own.

The reading is conservative where it must be sound: a weight read whose
owner cannot be resolved (``w.weight`` for some local ``w``) counts as a read
of every candidate layer below that module (the variable of a loop over
``self.layers`` counts for the layers in it), and a module whose source is
unavailable counts as reading them all. Not seen: code outside the model's
classes (module-level helper functions, hooks) and reads through
``parameters()`` or ``state_dict()``.
"""
from __future__ import annotations

import ast
import builtins
import collections
import functools
import inspect
import os
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

_PARAMETERS = ("weight", "bias")
_HARMLESS = ("device", "dtype")  # ``self.fc.weight.device`` is the same on every rank whatever the split
_PURE_MODULES = ("torch", "math", "builtins", "operator", "numpy")


@dataclass
class _Method:
    """One parsed method of a module's class."""

    cls: type
    node: ast.FunctionDef
    filename: str
    first_line: int
    lines: list[str]
    globals: dict[str, Any]

    @property
    def self_name(self) -> str:
        args = self.node.args.posonlyargs + self.node.args.args
        return args[0].arg if args else "self"

    def where(self, node: ast.AST) -> str:
        line = getattr(node, "lineno", self.node.lineno)
        code = self.lines[line - 1].strip() if line <= len(self.lines) else ""
        return f"{self.cls.__name__}.{self.node.name} at {self.filename}:{self.first_line + line - 1}: {code}"


def _user_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] not in ("torch", "builtins")


@functools.lru_cache(maxsize=None)
def _parse(cls: type, fn: types.FunctionType) -> _Method:
    lines, first = inspect.getsourcelines(fn)
    source = textwrap.dedent("".join(lines))
    node = next(n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    name = os.path.basename(inspect.getsourcefile(fn) or "?")
    return _Method(cls, node, name, first, source.splitlines(), fn.__globals__)


def methods(module: nn.Module) -> list[_Method] | str:
    """``forward`` and every method it reaches through ``self.name(...)`` / ``super().name(...)``, parsed.

    Only methods of the module's own (non-torch) classes are read; a module of
    torch's own classes gives ``[]``.

    Returns:
        The parsed methods, or a string saying why a source could not be read.

    Example:
        >>> [m.node.name for m in methods(model)]
        ['forward', '_mix']
    """
    found, wanted, seen = [], ["forward"], set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        for cls in type(module).__mro__:
            fn = cls.__dict__.get(name)
            if not (_user_class(cls) and isinstance(fn, types.FunctionType)):
                continue
            try:
                method = _parse(cls, fn)
            except (OSError, TypeError, SyntaxError, StopIteration) as err:
                return f"the source of {cls.__name__}.{name} is unavailable ({type(err).__name__})"
            found.append(method)
            wanted += [_called_on_self(call, method.self_name) for call in ast.walk(method.node)
                       if _called_on_self(call, method.self_name)]
    return found


def _called_on_self(node: ast.AST, self_name: str) -> str:
    """``name`` for a call ``self.name(...)`` or ``super().name(...)``; "" otherwise."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return ""
    owner = node.func.value
    if isinstance(owner, ast.Name) and owner.id == self_name:
        return node.func.attr
    if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
        return node.func.attr
    return ""


def self_path(expr: ast.AST, self_name: str) -> list[str] | None:
    """``self.a.b[0]`` -> ``["a", "b", "0"]``; None for anything not rooted at ``self`` by constant steps."""
    if isinstance(expr, ast.Name):
        return [] if expr.id == self_name else None
    if isinstance(expr, ast.Attribute):
        base = self_path(expr.value, self_name)
        return None if base is None else base + [expr.attr]
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
        key = expr.slice.value
        if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and key >= 0):
            base = self_path(expr.value, self_name)
            return None if base is None else base + [str(key)]
    return None


def _join(prefix: str, path: Iterable[str]) -> str:
    return ".".join([prefix, *path] if prefix else list(path))


def _below(name: str, prefix: str) -> bool:
    return bool(name) and (not prefix or name.startswith(prefix + "."))


def parameter_reads(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """The layers among ``names`` whose parameters the model's code reads itself, each with where.

    A read is ``<layer>.weight`` / ``<layer>.bias`` (or ``getattr(<layer>,
    "weight")``) in a method of any module holding the layer; ``.device`` and
    ``.dtype`` of them are harmless and ignored.

    Args:
        model: the model.
        names: qualified names of the candidate layers.

    Returns:
        ``{layer name: "Class.method at file.py:LINE: code"}`` for each layer read.

    Example:
        >>> parameter_reads(model, ["fc"])    # forward returns self.fc(x) + self.fc.weight.sum()
        {'fc': 'Net.forward at net.py:12: return self.fc(x) + self.fc.weight.sum()'}
    """
    names = set(names)
    reads: dict[str, str] = {}
    for owner, module in model.named_modules():
        below = sorted(n for n in names if _below(n, owner))
        parsed = methods(module) if below else []
        if isinstance(parsed, str):
            for name in below:
                reads.setdefault(name, f"{parsed}, so reads of its weights cannot be ruled out")
            continue
        for method in parsed:
            parents = {child: node for node in ast.walk(method.node) for child in ast.iter_child_nodes(node)}
            for node in ast.walk(method.node):
                target = _read_target(node, parents)
                if target is None:
                    continue
                path = self_path(target, method.self_name)
                if path is None and isinstance(target, ast.Name):  # for layer in self.layers: layer.weight
                    loop = _loop_over(target, method, parents)
                    hit = below if loop is None else [n for n in below if _below(n, _join(owner, loop))]
                else:
                    hit = below if path is None else [_join(owner, path)]
                for name in hit:
                    if name in names:
                        reads.setdefault(name, method.where(node))
    return reads


def _loop_over(name: ast.Name, method: _Method, parents: dict[ast.AST, ast.AST]) -> list[str] | None:
    """``["layers"]`` when ``name`` is the variable of an enclosing ``for name in self.layers`` and nothing but
    such loops binds it; None otherwise."""
    binders = [n for n in ast.walk(method.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
               and n.id == name.id]
    if not all(isinstance(parents.get(b), (ast.For, ast.AsyncFor)) and parents[b].target is b for b in binders):
        return None
    node: ast.AST | None = name
    while node is not None:
        node = parents.get(node)
        if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name) \
                and node.target.id == name.id:
            return self_path(node.iter, method.self_name) or None
    return None


def _read_target(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> ast.AST | None:
    """The expression whose weight or bias ``node`` reads, or None."""
    if isinstance(node, ast.Attribute) and node.attr in _PARAMETERS:
        parent = parents.get(node)
        harmless = isinstance(parent, ast.Attribute) and parent.value is node and parent.attr in _HARMLESS
        return None if harmless else node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in _PARAMETERS:
        return node.args[0]
    return None


def input_layers(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The layers among ``names`` that only ever see values computed from the model's input without parameters.

    Their input needs no gradient (for the model's own, gradient-free input),
    so a split layer there sends nothing in backward. The reading follows
    ``forward`` into submodules, ``nn.Sequential``, methods called on ``self``
    and ``super()``, and loops over a ``ModuleList``. Anything unsure - a call
    through a function outside the model, a loop that feeds a layer its own
    output - counts as needing a gradient, so the plan never promises less
    communication than the run sends.

    Example:
        >>> input_layers(model, ["fc1", "fc2"])   # forward: self.fc2(torch.tanh(self.fc1(x.flatten(1))))
        {'fc1'}
    """
    flow = _GradientFreeFlow(set(names))
    flow.call("", model, True)
    return {name for name, seen in flow.visits.items() if seen and all(seen)}


@dataclass
class _Scope:
    """One method being read: whose it is, which local names surely hold gradient-free values, which hold
    submodules (the variable of a loop over a ModuleList)."""

    owner: str
    module: nn.Module
    method: _Method
    free: set[str] = field(default_factory=set)
    locals: set[str] = field(default_factory=set)
    modules: dict[str, tuple[str, nn.Module]] = field(default_factory=dict)


class _GradientFreeFlow:
    """Forward data flow of one bit per value: computed from the input alone (no parameter touched)?"""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.visits: dict[str, list[bool]] = collections.defaultdict(list)
        self.stack: set[tuple[str, type, str]] = set()  # (owner, class, method) being read: no endless recursion

    def call(self, owner: str, module: nn.Module, free_args: bool) -> bool:
        """Record a call of ``module`` and say whether its output is surely gradient-free."""
        if owner in self.names:
            self.visits[owner].append(free_args)
            return False
        if not free_args:
            return False
        if isinstance(module, nn.Sequential):
            free = True
            for child_name, child in module.named_children():
                free = self.call(_join(owner, [child_name]), child, free)
            return free
        parsed = methods(module)
        forward = next((m for m in parsed if m.node.name == "forward"), None) if isinstance(parsed, list) else None
        if forward is not None:
            self.read(_Scope(owner, module, forward), True)
        return not any(p.requires_grad for p in module.parameters())

    def read(self, scope: _Scope, free_args: bool) -> None:
        key = (scope.owner, scope.method.cls, scope.method.node.name)
        if key in self.stack:
            return
        args = scope.method.node.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]
        params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
        scope.free = set(params) if free_args else set()
        scope.locals = set(params) | {n.id for n in ast.walk(scope.method.node)
                                      if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self.stack.add(key)
        try:
            self.block(scope.method.node.body, scope)
        finally:
            self.stack.discard(key)

    def helper(self, scope: _Scope, name: str, free_args: bool, base_of: type | None = None) -> None:
        """Read ``self.name(...)`` (or, with ``base_of``, ``super().name(...)``) for the layers it calls."""
        parsed = methods(scope.module)
        mro = type(scope.module).__mro__
        after = mro.index(base_of) if base_of in mro else -1
        found = [m for m in (parsed if isinstance(parsed, list) else []) if m.node.name == name
                 and mro.index(m.cls) > after]
        if found:
            self.read(_Scope(scope.owner, scope.module, found[0]), free_args)

    def block(self, statements: list[ast.stmt], scope: _Scope) -> None:
        for statement in statements:
            self.statement(statement, scope)

    def branches(self, bodies: list[list[ast.stmt]], scope: _Scope) -> None:
        """Any one of ``bodies`` runs: a name stays free only if every branch leaves it free."""
        before, results = set(scope.free), []
        for body in bodies:
            scope.free = set(before)
            self.block(body, scope)
            results.append(scope.free)
        scope.free = set.intersection(*results)

    def loop(self, body: list[ast.stmt], scope: _Scope) -> None:
        """The body runs any number of times: read it until what stays free stops changing."""
        while True:
            before = set(scope.free)
            self.block(body, scope)
            scope.free &= before
            if scope.free == before:
                return

    def unrolled(self, node: ast.For, scope: _Scope) -> bool:
        """``for layer in self.layers:`` over a ModuleList or Sequential: read the body once per child, in order."""
        path = self_path(node.iter, scope.method.self_name)
        container = _resolve(scope.module, path) if path else _MISSING
        if not (isinstance(node.target, ast.Name) and isinstance(container, (nn.ModuleList, nn.Sequential))
                and not node.orelse):
            return False
        for child_name, child in container.named_children():
            scope.modules[node.target.id] = (_join(scope.owner, [*path, child_name]), child)
            self.block(node.body, scope)
        scope.modules.pop(node.target.id, None)
        return True

    def statement(self, node: ast.stmt, scope: _Scope) -> None:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            free = node.value is not None and self.expr(node.value, scope)
            if isinstance(node, ast.AugAssign):
                free = free and self.expr(node.target, scope)
            self.assign(targets, free, scope)
        elif isinstance(node, ast.If):
            self.expr(node.test, scope)
            self.branches([node.body, node.orelse], scope)
        elif isinstance(node, ast.For) and self.unrolled(node, scope):
            pass
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.assign([node.target], self.expr(node.iter, scope), scope)
            self.loop(node.body, scope)
            self.block(node.orelse, scope)
        elif isinstance(node, ast.While):
            self.expr(node.test, scope)
            self.loop(node.body, scope)
            self.block(node.orelse, scope)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.expr(item.context_expr, scope)
                if item.optional_vars is not None:
                    self.assign([item.optional_vars], False, scope)
            self.block(node.body, scope)
        elif isinstance(node, ast.Try):
            self.branches([node.body, *[h.body for h in node.handlers], node.orelse, node.finalbody, []], scope)
        else:  # return, expression, raise, assert, ...: read what they compute; forget names they bind
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, scope)
            self.assign([n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)],
                        False, scope)

    def assign(self, targets: list[ast.AST], free: bool, scope: _Scope) -> None:
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name) and node.id != scope.method.self_name:
                    (scope.free.add if free and isinstance(target, (ast.Name, ast.Tuple, ast.List))
                     else scope.free.discard)(node.id)

    def expr(self, node: ast.AST, scope: _Scope) -> bool:
        """Whether ``node``'s value is surely gradient-free; records the layer calls inside it."""
        if isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            if node.id in scope.locals:
                return node.id in scope.free
            return _plain_value(_lookup(node.id, scope.method.globals))
        if isinstance(node, ast.Call):
            return self.call_expr(node, scope)
        path = self_path(node, scope.method.self_name)
        if path is not None:
            return _plain_value(_resolve(scope.module, path))
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.Set, ast.UnaryOp,
                             ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Starred)):
            return all([self.expr(child, scope) for child in ast.iter_child_nodes(node)
                        if isinstance(child, ast.expr)])
        for child in ast.iter_child_nodes(node):  # lambdas, comprehensions, f-strings: unsure
            if isinstance(child, ast.expr):
                self.expr(child, scope)
        return False

    def call_expr(self, node: ast.Call, scope: _Scope) -> bool:
        free_args = all([self.expr(a, scope) for a in [*node.args, *(k.value for k in node.keywords)]])
        func = node.func
        if isinstance(func, ast.Name) and func.id in scope.modules:  # layer(h) in a loop over self.layers
            return self.call(*scope.modules[func.id], free_args)
        path = self_path(func, scope.method.self_name)
        if path:
            target = _resolve(scope.module, path)
            if isinstance(target, nn.Module):
                return self.call(_join(scope.owner, path), target, free_args)
            if len(path) == 1:
                self.helper(scope, path[0], free_args)
            return False  # a method's result is not followed
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) \
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "super":
            self.helper(scope, func.attr, free_args, base_of=scope.method.cls)
            return False
        root = func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id not in scope.locals:  # torch.tanh, F.relu, len, helper(...)
            return free_args and _pure(_resolve_global(func, scope.method.globals))
        if isinstance(func, ast.Attribute):  # a method of a local value: x.view(...), x.flatten(1), h.detach()
            free_value = self.expr(func.value, scope)
            return func.attr == "detach" or (free_args and free_value and not func.attr.startswith("requires_grad"))
        return False


_MISSING = object()


def _lookup(name: str, namespace: dict[str, Any]) -> Any:
    return namespace.get(name, getattr(builtins, name, _MISSING))


def _resolve(module: nn.Module, path: list[str]) -> Any:
    value: Any = module
    for step in path:
        if isinstance(value, nn.Module) and step in value._modules:
            value = value._modules[step]
        else:
            value = getattr(value, step, _MISSING)
        if value is _MISSING:
            return _MISSING
    return value


def _resolve_global(expr: ast.AST, namespace: dict[str, Any]) -> Any:
    if isinstance(expr, ast.Name):
        return _lookup(expr.id, namespace)
    if isinstance(expr, ast.Attribute):
        base = _resolve_global(expr.value, namespace)
        return _MISSING if base is _MISSING else getattr(base, expr.attr, _MISSING)
    return _MISSING


def _plain_value(value: Any) -> bool:
    """A value that carries no parameter: not a module, not a tensor that requires a gradient."""
    if value is _MISSING or isinstance(value, nn.Module):
        return False
    return not (isinstance(value, torch.Tensor) and value.requires_grad)


def _pure(func: Any) -> bool:
    """A function of torch, math, builtins...: its result depends on its arguments only."""
    if func is _MISSING or isinstance(func, nn.Module):
        return False
    module = getattr(func, "__module__", None) or ""
    return module.split(".")[0] in _PURE_MODULES
