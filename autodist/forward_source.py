"""What a model's own code does with its Linear layers, read from the source of its classes (ast).

When torch.fx cannot trace a model, the rewriter swaps plain ``nn.Linear``
modules one by one. The swap is exact for whatever the code does with a
layer's *output*, but not for code that reads a layer's *parameters* itself
(``self.fc.weight.pow(2).sum()`` would see this rank's shard), and without a
graph the plan cannot tell which layers are fed the model's input (their
backward sends nothing). Both questions are answered here, conservatively.

Parameter reads: every function of every class of the model's modules that
is not torch's own is read, wherever it is called from - methods, property
accessors, static and class methods, functions nested in them - and so are
the module-level functions of the same file that they name; only the body of
``__init__`` itself is skipped (it ran before ``parallelize``). A read
``self.a.b.weight`` names its layer. A read whose owner cannot be resolved
(``w.weight`` for a local or an argument ``w``) counts as a read of every
candidate below the module and of every layer the model's code hands on
(passes, stores, returns, loops over, reaches through torch's own methods such
as ``self.modules()``); a loop variable over ``self.layers`` counts for the
layers in it. A function whose source is unavailable counts as such a read.

Layers fed the input: the data flow is followed from ``forward`` through
submodules, ``nn.Sequential``, the methods and properties of the model's
classes and loops over a ``ModuleList``. Whatever it cannot follow - a layer
or a method handed to a function (``checkpoint(self._body, x)``), a callable
argument, a function outside the model, torch's own methods of a module, a
module with forward hooks - counts as calling the layers below it on an input
that needs a gradient, so the plan never shows less backward communication
than the run sends.

Not seen: code outside the model's classes and their files (helpers imported
from elsewhere, hooks registered from outside, the training script), layers
held by objects that are not modules, and reads through ``parameters()``,
``state_dict()`` or ``_parameters``.
"""
from __future__ import annotations

import ast
import builtins
import collections
import dataclasses
import functools
import inspect
import os
import types
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch
from torch import nn

_PARAMETERS = ("weight", "bias")
_HARMLESS = ("device", "dtype")  # ``self.fc.weight.device`` is the same on every rank whatever the split
_PURE_MODULES = ("torch", "math", "builtins", "operator", "numpy")
# torch methods of a module that hand out tensors, never modules (reads through them are not seen: see above)
_TENSOR_METHODS = ("parameters", "named_parameters", "buffers", "named_buffers")
_UNAVAILABLE = (OSError, TypeError, SyntaxError, StopIteration)
# written by @dataclass without a source; they compare, hash and print fields, never read a weight
_DATACLASS_METHODS = ("__init__", "__repr__", "__eq__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__",
                      "__setattr__", "__delattr__")
_MISSING = object()


@dataclass
class _Function:
    """One parsed function of the model's code."""

    name: str  # qualified: "Net.forward"
    cls: type | None  # the class it was found in (for ``super()``); None for a module-level function
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
    filename: str
    first_line: int  # the file's line of ``lines[0]``
    lines: list[str]
    globals: dict[str, Any]
    self_name: str  # "" where the first argument is not the instance (static and class methods, functions)

    def where(self, node: ast.AST) -> str:
        line = getattr(node, "lineno", self.node.lineno)
        return f"{self.name} at {self.filename}:{self.first_line + line - 1}: {self.lines[line - 1].strip()}"


def _user(cls: type | None) -> bool:
    return cls is not None and cls.__module__.split(".")[0] not in ("torch", "builtins")


@functools.lru_cache(maxsize=None)
def _parse(fn: Any, cls: type | None, bound: bool) -> _Function:
    fn = inspect.unwrap(fn)
    lines, first = inspect.getsourcelines(fn)
    indented = int(lines[0][:1].isspace())  # a method: parse it as the body of a block
    lines = ["if 1:\n"] * indented + lines
    tree = ast.parse("".join(lines))
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    args = node.args.posonlyargs + node.args.args
    return _Function(fn.__qualname__, cls, node, os.path.basename(inspect.getsourcefile(fn) or "?"),
                     first - indented, [line.rstrip("\n") for line in lines], fn.__globals__,
                     args[0].arg if bound and args else "")


def _functions(cls: type) -> Iterator[tuple[str, Any, bool]]:
    """(name, function, bound) for each function in a class's own namespace; a callable of another kind comes
    as it is (its source is then unavailable)."""
    for name, value in vars(cls).items():
        if isinstance(value, (staticmethod, classmethod)):
            yield name, value.__func__, False
        elif isinstance(value, property):
            yield from ((name, f, True) for f in (value.fget, value.fset, value.fdel) if f is not None)
        elif (callable(value) or hasattr(type(value), "__get__")) and not isinstance(
                value, (type, types.GetSetDescriptorType, types.MemberDescriptorType)):
            yield name, value, True


def _sources(model: nn.Module) -> list[tuple[nn.Module, _Function | str]]:
    """Each module with each function of its classes and of their files that those name; a string says why a
    source is unavailable."""
    found: list[tuple[nn.Module, _Function | str]] = []
    for module in model.modules():
        todo = [(f"{cls.__qualname__}.{name}", fn, cls, bound)
                for cls in type(module).__mro__ if _user(cls) for name, fn, bound in _functions(cls)]
        done: set[int] = set()
        while todo:
            name, fn, cls, bound = todo.pop()
            if id(fn) in done:
                continue
            done.add(id(fn))
            try:
                parsed = _parse(fn, cls, bound)
            except _UNAVAILABLE as err:
                if not (dataclasses.is_dataclass(cls) and name.rpartition(".")[2] in _DATACLASS_METHODS):
                    found.append((module, f"the source of {name} is unavailable ({type(err).__name__})"))
                continue
            found.append((module, parsed))
            named = {parsed.globals.get(n.id) for n in ast.walk(parsed.node) if isinstance(n, ast.Name)}
            todo += [(f.__qualname__, f, None, False) for f in named
                     if isinstance(f, types.FunctionType) and f.__globals__ is parsed.globals]  # same file
    return found


def self_path(expr: ast.AST, self_name: str) -> list[str] | None:
    """``self.a.b[0]`` -> ``["a", "b", "0"]``; None for anything not rooted at ``self`` by constant steps."""
    if isinstance(expr, ast.Name):
        return [] if self_name and expr.id == self_name else None
    if isinstance(expr, ast.Attribute):
        base = self_path(expr.value, self_name)
        return None if base is None else base + [expr.attr]
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant):
        key = expr.slice.value
        if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool) and key >= 0):
            base = self_path(expr.value, self_name)
            return None if base is None else base + [str(key)]
    return None


def _layers(model: nn.Module, names: Iterable[str]) -> dict[int, str]:
    names = set(names)
    return {id(m): n for n, m in model.named_modules() if n in names}


def _below(module: Any, layers: dict[int, str]) -> list[str]:
    return [layers[id(m)] for m in module.modules() if id(m) in layers] if isinstance(module, nn.Module) else []


def parameter_reads(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """The layers among ``names`` whose parameters the model's code may read itself, each with where.

    A read is ``<layer>.weight`` / ``<layer>.bias`` (or ``getattr(<layer>,
    "weight")``) in any function of the model's classes; ``.device`` and
    ``.dtype`` of them are harmless and ignored.

    Args:
        model: the model.
        names: qualified names of the candidate layers.

    Returns:
        ``{layer name: "Class.method at file.py:LINE: code"}`` for each layer read.

    Example:
        >>> parameter_reads(model, ["fc"])    # a method returns self.fc.weight.pow(2).sum()
        {'fc': 'Net.penalty at net.py:14: return self.fc.weight.pow(2).sum()'}
    """
    layers = _layers(model, names)
    sources = _sources(model)
    handed_on = {n for m, f in sources if not isinstance(f, str) for x in _escapes(m, f) for n in _below(x, layers)}
    reads: dict[str, str] = {}
    for module, function in sources:
        anything = _below(module, layers) + sorted(handed_on)
        if isinstance(function, str):
            for name in anything:
                reads.setdefault(name, f"{function}, so reads of its weights cannot be ruled out")
            continue
        parents, ran = _parents(function.node), _init_body(function)
        for node in ast.walk(function.node):
            target = None if node in ran else _read_target(node, parents)
            if target is not None:
                for name in _read_of(module, function, target, parents, layers, anything):
                    reads.setdefault(name, function.where(node))
    return reads


def _read_of(module: nn.Module, function: _Function, target: ast.AST, parents: dict[ast.AST, ast.AST],
             layers: dict[int, str], anything: list[str]) -> list[str]:
    """The layers a read of ``target.weight`` may be of."""
    path = self_path(target, function.self_name)
    if path is not None:  # self.a.b.weight: that layer, or nothing for a plain value
        value = _resolve(module, path)
        if isinstance(value, nn.Module):
            return [layers[id(value)]] if id(value) in layers else []
        return [] if _inert(value) else anything
    loop = _loop_over(target, function, parents) if isinstance(target, ast.Name) else None
    container = _MISSING if loop is None else _resolve(module, loop)
    return _below(container, layers) if isinstance(container, nn.Module) else anything


def _init_body(function: _Function) -> set[ast.AST]:
    """The nodes of ``__init__`` that ran before ``parallelize``: all but the functions defined in it."""
    if getattr(function.node, "name", "") != "__init__" or not function.self_name:
        return set()
    later = {n for d in ast.walk(function.node) if d is not function.node
             and isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for n in ast.walk(d)}
    return set(ast.walk(function.node)) - later


def _parents(root: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def _escapes(module: nn.Module, function: _Function) -> Iterator[Any]:
    """The modules ``function`` hands on: the code that gets them may read their layers' weights."""
    parents = _parents(function.node)
    for node in ast.walk(function.node):
        path, parent = self_path(node, function.self_name), parents.get(node)
        if path is None or not isinstance(getattr(node, "ctx", ast.Load()), ast.Load) or (
                isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node
                and self_path(parent, function.self_name) is not None):
            continue  # not rooted at self, assigned to, or not the whole chain
        kind, what = _reference(module, path, isinstance(parent, ast.Call) and parent.func is node)
        if kind == "escape":
            yield what


def _loop_over(name: ast.Name, function: _Function, parents: dict[ast.AST, ast.AST]) -> list[str] | None:
    """``["layers"]`` when ``name`` is the variable of an enclosing ``for name in self.layers`` and nothing but
    such loops binds it; None otherwise."""
    binders = [n for n in ast.walk(function.node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
               and n.id == name.id]
    if not all(isinstance(parents.get(b), (ast.For, ast.AsyncFor)) and parents[b].target is b for b in binders):
        return None
    node: ast.AST | None = name
    while node is not None:
        node = parents.get(node)
        if isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name) \
                and node.target.id == name.id:
            return self_path(node.iter, function.self_name) or None
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


def _reference(module: nn.Module, path: list[str], called: bool) -> tuple[str, Any]:
    """What ``self.<path>`` (called or not) is to the code, without running any of it.

    ``("module", m)``: a submodule called. ``("method", (holder, class, function))``:
    a method of the model's classes called, or a property read. ``("data", value)``:
    a tensor or plain value (called: a method of one, and the value is its owner).
    ``("escape", m)``: anything else, which may call or read the layers below the
    last module ``m`` on the path in ways not followed here.
    """
    holder, value, last = None, module, module
    for step in path:
        holder, value = value, _attr(value, step)
        last = value if isinstance(value, nn.Module) else last
    if isinstance(value, nn.Module):
        return ("module" if called else "escape"), value
    if isinstance(holder, nn.Module) and path[-1] not in vars(holder):
        if called and path[-1] in _TENSOR_METHODS:  # next(self.parameters()).device
            return "data", holder
        cls, found = _class_attr(holder, path[-1])
        fn = found if called else found.fget if isinstance(found, property) else None
        if isinstance(fn, types.FunctionType) and _user(cls):
            return "method", (holder, cls, fn)
    owner = holder if called else value
    return ("data", owner) if _inert(owner) else ("escape", last)


def _attr(value: Any, step: str) -> Any:
    """One step of ``self.a.b[0]``; a module's properties and methods come from its class, unbound and not run."""
    if isinstance(value, nn.Module):
        for store in (value._modules, value._parameters, value._buffers, vars(value)):
            if step in store:
                return store[step]
        return _class_attr(value, step)[1]
    if isinstance(value, (list, tuple)) and step.isdigit():
        return value[int(step)] if int(step) < len(value) else _MISSING
    if isinstance(value, dict):
        return value.get(step, _MISSING)
    try:
        return getattr(value, step, _MISSING)
    except Exception:  # noqa: BLE001 - a value the reading cannot see into counts as unknown
        return _MISSING


def _class_attr(obj: Any, name: str, after: type | None = None) -> tuple[type | None, Any]:
    """(defining class, raw value) of ``name`` in ``type(obj)``'s MRO, searched past ``after`` if given."""
    mro = type(obj).__mro__
    for cls in mro[mro.index(after) + 1 if after in mro else 0:]:
        if name in vars(cls):
            return cls, vars(cls)[name]
    return None, _MISSING


def _inert(value: Any, grad: bool = True) -> bool:
    """Data that can neither call a layer nor hand one on (tensors, numbers, strings, containers of them);
    with ``grad=False`` also no tensor that requires a gradient."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return all(_inert(v, grad) for v in value)
    if isinstance(value, torch.Tensor):
        return grad or not value.requires_grad
    return value is not _MISSING and not callable(value) and not hasattr(type(value), "__get__")


def _resolve(module: nn.Module, path: list[str]) -> Any:
    return functools.reduce(_attr, path, module)


def input_layers(model: nn.Module, names: Iterable[str]) -> set[str]:
    """The layers among ``names`` that only ever see values computed from the model's input without parameters.

    Their input needs no gradient (for the model's own, gradient-free input),
    so a split layer there sends nothing in backward. Anything the reading
    cannot follow counts as needing a gradient, so the plan never promises
    less communication than the run sends.

    Example:
        >>> input_layers(model, ["fc1", "fc2"])   # forward: self.fc2(torch.tanh(self.fc1(x.flatten(1))))
        {'fc1'}
    """
    flow = _GradientFreeFlow(_layers(model, names))
    flow.call(model, True)
    return {name for name, seen in flow.visits.items() if seen and all(seen)}


@dataclass
class _Scope:
    """One function being read: whose it is, which local names surely hold gradient-free values, which hold
    submodules (the variable of a loop over a ModuleList)."""

    module: nn.Module
    function: _Function
    free: set[str] = field(default_factory=set)
    locals: set[str] = field(default_factory=set)
    modules: dict[str, nn.Module] = field(default_factory=dict)


class _GradientFreeFlow:
    """Forward data flow of one bit per value: computed from the input alone (no parameter touched)?"""

    def __init__(self, layers: dict[int, str]) -> None:
        self.layers = layers
        self.visits: dict[str, list[bool]] = collections.defaultdict(list)
        self.stack: set[tuple[int, Any]] = set()  # (module, function) being read: no endless recursion

    def unsure(self, module: Any) -> None:
        """Code not followed here may call the layers below ``module`` on anything."""
        for name in _below(module, self.layers):
            self.visits[name].append(False)

    def call(self, module: nn.Module, free_args: bool) -> bool:
        """Record a call of ``module`` and say whether its output is surely gradient-free."""
        hooked = bool(module._forward_pre_hooks or module._forward_hooks)  # they may change what goes in or out
        if id(module) in self.layers:
            self.visits[self.layers[id(module)]].append(free_args and not hooked)
            return False
        if type(module).forward is nn.Sequential.forward and not hooked:
            free = free_args
            for child in module.children():
                free = self.call(child, free)
            return free
        cls, forward = _class_attr(module, "forward")
        if free_args and not hooked and isinstance(forward, types.FunctionType) and _user(cls) \
                and not _user(_class_attr(module, "__call__")[0]):
            self.read(module, cls, forward, True)
        else:
            self.unsure(module)
        return free_args and not hooked and not any(p.requires_grad for p in module.parameters())

    def read(self, module: nn.Module, cls: type | None, fn: Any, free_args: bool) -> None:
        try:
            function = _parse(fn, cls, True)
        except _UNAVAILABLE:
            function = None
        key = (id(module), fn)
        if function is None or key in self.stack:  # unreadable or recursive: the calls inside are not followed
            self.unsure(module)
            return
        node = function.node
        args = node.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs][1:]
        params += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
        scope = _Scope(module, function, set(params) if free_args else set())
        scope.locals = set(params) | {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                                      and isinstance(n.ctx, ast.Store)}
        self.stack.add(key)
        try:
            self.block(node.body if isinstance(node.body, list) else [ast.Return(node.body)], scope)
        finally:
            self.stack.discard(key)

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
        path = self_path(node.iter, scope.function.self_name)
        container = _resolve(scope.module, path) if path else _MISSING
        name = node.target.id if isinstance(node.target, ast.Name) else ""
        rebound = any(isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id == name
                      for statement in node.body for n in ast.walk(statement))
        if not name or rebound or not isinstance(container, (nn.ModuleList, nn.Sequential)) or node.orelse:
            return False
        for child in container.children():
            scope.modules[name] = child
            self.block(node.body, scope)
        scope.modules.pop(name, None)
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
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # runs later, on anything
            saved, scope.free = scope.free, set()
            self.block(node.body, scope)
            scope.free = saved - {node.name}
        elif any(isinstance(n, ast.stmt) for n in ast.walk(node) if n is not node):  # match, try*: not followed
            self.unsure(scope.module)
            scope.free = set()
        else:  # return, expression, raise, assert, ...: read what they compute; forget names they bind
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, scope)
            self.assign([n for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)],
                        False, scope)

    def assign(self, targets: list[ast.AST], free: bool, scope: _Scope) -> None:
        for target in targets:
            for node in ast.walk(target):
                if isinstance(node, ast.Name) and node.id != scope.function.self_name:
                    (scope.free.add if free and isinstance(target, (ast.Name, ast.Tuple, ast.List))
                     else scope.free.discard)(node.id)

    def expr(self, node: ast.AST, scope: _Scope) -> bool:
        """Whether ``node``'s value is surely gradient-free; records the layer calls inside it."""
        if isinstance(node, ast.Constant):
            return True
        path = self_path(node, scope.function.self_name)
        if path is not None:
            return self.reference(scope, path, False, True)
        if isinstance(node, ast.Name):
            if node.id in scope.modules:  # a loop's layer handed on
                self.unsure(scope.modules[node.id])
                return False
            if node.id in scope.locals:
                return node.id in scope.free
            return _inert(_lookup(node.id, scope.function.globals), grad=False)
        if isinstance(node, ast.Call):
            return self.call_expr(node, scope)
        if isinstance(node, (ast.Attribute, ast.Subscript, ast.Slice, ast.Tuple, ast.List, ast.Set, ast.UnaryOp,
                             ast.BinOp, ast.BoolOp, ast.Compare, ast.IfExp, ast.Starred)):
            return all([self.expr(child, scope) for child in ast.iter_child_nodes(node)
                        if isinstance(child, ast.expr)])
        saved, scope.free = scope.free, set()  # lambdas, comprehensions, f-strings: their names hold anything
        for child in ast.iter_child_nodes(node):
            for part in [child] if isinstance(child, ast.expr) else ast.iter_child_nodes(child):
                if isinstance(part, ast.expr):
                    self.expr(part, scope)
        scope.free = saved
        return False

    def reference(self, scope: _Scope, path: list[str], called: bool, free_args: bool) -> bool:
        """``self.<path>``, or a call of it: follow what can be followed, count the rest as unsure."""
        kind, what = _reference(scope.module, path, called)
        if kind == "module":
            return self.call(what, free_args)
        if kind == "method":
            self.read(*what, free_args)
            return False  # a method's result is not followed
        if kind == "data":
            return free_args and _inert(what, grad=False)
        self.unsure(what)
        return False

    def call_expr(self, node: ast.Call, scope: _Scope) -> bool:
        free_args = all([self.expr(a, scope) for a in [*node.args, *(k.value for k in node.keywords)]])
        func = node.func
        path = self_path(func, scope.function.self_name)
        if path is not None:
            return self.reference(scope, path, True, free_args)
        if isinstance(func, ast.Name) and func.id in scope.modules:  # layer(h) in a loop over self.layers
            return self.call(scope.modules[func.id], free_args)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Call) \
                and isinstance(func.value.func, ast.Name) and func.value.func.id == "super":
            cls, fn = _class_attr(scope.module, func.attr, after=scope.function.cls)
            if isinstance(fn, types.FunctionType) and _user(cls):
                self.read(scope.module, cls, fn, free_args)
            else:
                self.unsure(scope.module)
            return False
        root = func
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id not in scope.locals:  # torch.tanh, F.relu, len, helper(...)
            return free_args and _pure(_resolve_global(func, scope.function.globals))
        if isinstance(func, ast.Attribute):  # a method of a local value: x.view(...), x.flatten(1), h.detach()
            free_value = self.expr(func.value, scope)
            free = func.attr == "detach" or (free_args and free_value and not func.attr.startswith("requires_grad"))
            if not free and func.attr.endswith("_") and isinstance(func.value, ast.Name):  # in place: x.add_(w)
                scope.free.discard(func.value.id)
            return free
        self.expr(func, scope)  # getattr(self, name)(x), self.layers[i](x): what it reaches is unsure
        return False


def _lookup(name: str, namespace: dict[str, Any]) -> Any:
    return namespace.get(name, getattr(builtins, name, _MISSING))


def _resolve_global(expr: ast.AST, namespace: dict[str, Any]) -> Any:
    if isinstance(expr, ast.Name):
        return _lookup(expr.id, namespace)
    if isinstance(expr, ast.Attribute):
        base = _resolve_global(expr.value, namespace)
        return _MISSING if base is _MISSING else getattr(base, expr.attr, _MISSING)
    return _MISSING


def _pure(func: Any) -> bool:
    """A function of torch, math, builtins...: its result depends on its arguments only (a callable argument
    makes those not gradient-free, so ``checkpoint(self._body, x)`` is not)."""
    if func is _MISSING or isinstance(func, nn.Module):
        return False
    module = getattr(func, "__module__", None) or ""
    return module.split(".")[0] in _PURE_MODULES
