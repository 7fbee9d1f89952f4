"""What an answer cell's code does that an exercise never needs: a list of lines to look at.

``suspicious_code(source)`` parses an answer cell with :mod:`ast` and reports code that reaches
into the graders or the reference, the interpreter's module table or builtins, a function's code
object or a tensor's raw storage, patches an imported module or a class reached through
``type()``, subclasses torch.Tensor, passes a protected module around as a value, imports a module
by a string (``pkgutil``) or starts threads (torch's function modes, the grader's records, are per
thread), writes files, starts processes or talks to the gradebook. Comments and strings never count
(an honest comment citing ``graders/machine/tolerances.py`` is not a finding), and neither do
``import graders`` and ``graders.check("chNN.M", fn)``, nor imports from ``reference`` (solutions
use ``LoRABatchInfo``, ``torch_ref``; patching the reference is a finding), nor the torch / triton /
math code of any chapter's solution (tests/test_verify.py checks every solution cell and every mutant).

``suspicious_code(source, exercise_id)`` also reports an answer that uses that exercise's own
reference (:func:`graders.machine.registry.shown_reference`, what ``show_reference`` prints): an import, an
attribute, a ``getattr``/``vars()`` lookup with a constant name, ``importlib.import_module`` or
``__import__`` with a constant name that reaches an object of ``reference`` bearing the
reference's name (``from reference.lora_math import lora_forward`` for ch01.1, and the Triton
``reference.ops.sgmv_shrink`` for ch02.6 as well as ``reference.ops.torch_ref.sgmv_shrink``); for a
reference that is a method (ch08.2's ``StaticLoRABatch.update``), a subclass of its class that does
not define the method, a call through ``super()`` to it, or the class bound to a new name. Imports
of other objects of ``reference`` stay unflagged (solutions use them).

A finding is a pointer for the instructor ("line N: ... (look at this)"), never proof of tampering:
the trusted re-grade's scores are what count. The check sees what the code says, not what it
computes at run time, so it complements the sandbox rather than replacing it.
"""
from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["suspicious_code"]

#: Modules an exercise never needs: the gradebook (sqlite3), processes, signals, raw memory, network.
FORBIDDEN_MODULES = frozenset({"sqlite3", "subprocess", "multiprocessing", "ctypes", "signal", "socket",
                               "importlib", "builtins", "_thread", "gc",
                               # a module by its name as a string (pkgutil.resolve_name, runpy), and other
                               # threads, where torch's function modes (the grader's records) do not reach
                               "pkgutil", "runpy", "zipimport", "threading", "concurrent", "asyncio",
                               # a tensor's bytes without a tensor method the grader's records see
                               "pickle", "marshal", "copyreg"})
#: Modules whose object an answer has no business passing around as a value (``f(graders)``): what
#: a function reaches through its parameter is not followed here.
VALUE_PROTECTED = frozenset({"graders", "sys", "builtins", "importlib", "pkgutil", "gc", "os", "shutil", "torch"})
#: Names an answer cell has without importing them (graders.machine.runner.PREAMBLE): modules.
PREAMBLE_MODULES = frozenset({"graders", "torch", "math"})
#: torch modules that hold the function-mode stack the grader's checks push (a learner's answer needs none).
TORCH_MACHINERY_PREFIXES = ("torch._C", "torch.overrides", "torch.utils._python_dispatch", "torch.utils._device",
                            "torch._dynamo")
#: torch functions that read or change process-wide defaults.
TORCH_DEFAULTS = ("set_default_device", "get_default_device", "set_default_dtype", "set_default_tensor_type")
#: torch.cuda's process-wide switch that reports synchronizations (the grader's GPU record of host reads).
TORCH_CUDA_DEFAULTS = ("set_sync_debug_mode", "get_sync_debug_mode")
#: ``os`` functions that start or signal processes or change files.
OS_CALLS = frozenset({"system", "fork", "forkpty", "kill", "killpg", "setsid", "popen", "utime", "remove",
                      "unlink", "rename", "renames", "replace", "rmdir", "removedirs", "truncate", "chmod",
                      "chown", "link", "symlink", "posix_spawn", "posix_spawnp"})
OS_PREFIXES = ("spawn", "exec")
#: Names whose attributes an answer cell has no business assigning (besides any module it imported).
PROTECTED_ROOTS = frozenset({"graders", "reference", "torch", "triton", "math", "sys", "os", "builtins"})
#: Attributes that lead from an object to a module's or a frame's namespace.
NAMESPACE_ATTRS = frozenset({"__globals__", "__builtins__", "f_globals", "f_locals", "f_builtins", "f_back",
                             "_getframe", "__subclasses__", "tb_frame", "gi_frame", "cr_frame", "__mro__", "__bases__"})
#: Attributes that lead to a function's code object, which can be rebuilt under another file name (the
#: grader's records name the answer cell's lines by theirs) or replaced.
CODE_ATTRS = frozenset({"__code__", "f_code", "gi_code", "cr_code", "ag_code"})
#: Tensor methods that reach a tensor's raw storage, whose reads torch's function modes never see.
STORAGE_ATTRS = frozenset({"untyped_storage", "storage", "_typed_storage", "_untyped_storage", "data_ptr"})
#: torch's ways to a tensor's bytes outside its methods (a file, a DLPack capsule).
TORCH_BYTES = ("torch.save", "torch.load", "torch.utils.dlpack", "torch.to_dlpack")
_WRITE_MODE_CHARS = set("wax+")
_GRADERS_DIR = Path(__file__).resolve().parents[1]
#: The graders' subpackages and modules (``graders.machine``, ``graders.course``, ...): reaching them
#: from an answer cell is never needed (``graders.check`` and ``graders.show_reference`` live in the
#: package itself).
GRADERS_SUBMODULES = frozenset({p.stem for p in _GRADERS_DIR.glob("*.py") if p.stem != "__init__"}
                               | {p.parent.name for p in _GRADERS_DIR.glob("*/__init__.py")})


def reference_targets(exercise_id: str | None) -> list[tuple[list[str], list[str]]]:
    """The exercise's own reference objects as (module parts, qualname parts): ``"ch01.1"`` gives
    ``[(["reference", "lora_math"], ["lora_forward"])]``; [] for None or an unknown id."""
    if exercise_id is None:
        return []
    from graders.machine.registry import shown_reference

    out = []
    for name in shown_reference(exercise_id):
        module, _, qualname = name.partition(":")
        out.append((module.split("."), qualname.split(".")))
    return out


def suspicious_code(source: str, exercise_id: str | None = None) -> list[str]:
    """Lines of an answer cell whose code does something an exercise never needs.

    Args:
        source: the answer cell's source (Python; IPython magics and ``!`` lines count as unparsable).
        exercise_id: the exercise the cell answers: its own reference used by the cell is a finding
            too (the score stands; the instructor decides).

    Returns:
        One line per finding, in source order, each ``"line N: <what> (look at this)"``; empty
        when nothing was found. A cell that does not parse gives one finding. Never raises for any
        string input.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes
        line = getattr(e, "lineno", None) or 1
        return [f"line {line}: the cell does not parse as Python ({type(e).__name__}: "
                f"{getattr(e, 'msg', e)}), so it was not checked (look at this)"]
    except (RecursionError, MemoryError) as e:
        return [f"line 1: the cell is nested too deeply to parse ({type(e).__name__}), so it was not checked "
                "(look at this)"]
    try:
        visitor = _Visitor(_bound_names(tree), exercise_id)
        visitor.attribute_bases = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        visitor.visit(tree)  # recursive: a valid expression of a few thousand terms exhausts the stack
    except (RecursionError, MemoryError) as e:
        return [f"line 1: the cell is nested too deeply to check ({type(e).__name__}: an expression or "
                "statement thousands of levels deep), so it was not checked (look at this)"]
    seen: set[tuple[int, str]] = set()
    out = []
    for line, what in sorted(visitor.findings, key=lambda f: f[0]):
        if (line, what) not in seen:
            seen.add((line, what))
            out.append(f"line {line}: {what} (look at this)")
    return out


def _torch_machinery(path: str) -> str | None:
    """The part of torch that ``path`` reaches, when it is the function-mode stack or the
    process-wide defaults: what the grader's host-read and default-device checks are built on
    (graders.machine.runner), never an exercise's; else None."""
    for prefix in TORCH_MACHINERY_PREFIXES:
        if path == prefix or path.startswith(prefix + "."):
            return prefix
    parts = path.split(".")
    if parts[:2] == ["torch", "cuda"] and parts[2:3] and parts[2] in TORCH_CUDA_DEFAULTS:
        return ".".join(parts[:3])
    return ".".join(parts[:2]) if parts[0] == "torch" and parts[1:2] and parts[1] in TORCH_DEFAULTS else None


def _bound_names(tree: ast.AST) -> set[str]:
    """Names the cell binds to its own values (variables, parameters, functions, classes): a
    variable called ``reference`` or ``os`` is not the module of that name."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
    return names


#: Calls that import a module named by a string: ``importlib.import_module(name)``, ``__import__(name)``.
_IMPORT_CALLS = frozenset({"importlib.import_module", "importlib.__import__", "__import__", "builtins.__import__"})


class _Visitor(ast.NodeVisitor):
    def __init__(self, bound: set[str], exercise_id: str | None = None) -> None:
        self.findings: list[tuple[int, str]] = []
        self.exercise_id = exercise_id
        #: the exercise's own reference objects (module parts, qualname parts)
        self.targets = reference_targets(exercise_id)
        #: reference modules the cell star-imported (a bare name may come from them)
        self.star_reference: list[str] = []
        #: names the cell binds to values of its own (not modules), unless aliased below
        self.bound = bound
        #: local name -> the dotted module path (or module attribute) it is bound to by an import
        #: (``import numpy as np`` binds np -> numpy) or by a plain alias (``g = graders``).
        self.aliases: dict[str, str] = {}
        #: top-level modules the cell imported
        self.imported: set[str] = set()
        #: ids of the Name nodes that are the base of an attribute (``graders`` in ``graders.check``)
        self.attribute_bases: set[int] = set()
        #: names bound to a module object by an ``import`` statement (``import os``, ``import a.b as c``)
        self.module_names: set[str] = set()
        #: names bound to some object's class (``T = type(x)``, ``T = x.__class__``)
        self.class_names: set[str] = set()

    # -- helpers ---------------------------------------------------------------------------------
    def flag(self, node: ast.AST, what: str) -> None:
        self.findings.append((getattr(node, "lineno", 1), what))

    def name_path(self, name: str) -> str | None:
        """What a bare name refers to: its import alias, None for the cell's own variables, else
        the name itself (``sys``, ``graders``: the modules of that name)."""
        if name in self.aliases:
            return self.aliases[name]
        return None if name in self.bound else name

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted path a name/attribute chain refers to, through import aliases (its base may
        also be an import by a constant name: ``importlib.import_module("a.b").c`` is ``a.b.c``)."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            head = self.name_path(node.id)
        elif attrs:
            head = self.imported_by_call(node)
        else:
            return None
        return None if head is None else ".".join([head, *reversed(attrs)])

    def module_rooted(self, path: str | None) -> bool:
        """``path`` hangs from a module the cell imported, or from one of the protected names."""
        return path is not None and path.split(".")[0] in (self.imported | PROTECTED_ROOTS)

    def root(self, node: ast.AST) -> str | None:
        """The name an expression's object hangs from: ``a`` for ``a.b[0].c``, ``getattr(a, ..)``,
        ``vars(a)``, ``a.__dict__``; resolved through aliases to its module path."""
        while True:
            if isinstance(node, (ast.Attribute, ast.Subscript, ast.Starred)):
                node = node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in {"getattr", "vars"} and node.args):
                node = node.args[0]
            else:
                break
        if isinstance(node, ast.Name):
            return self.name_path(node.id)
        return self.imported_by_call(node)

    # -- the exercise's own reference -----------------------------------------------------------
    def reference_hit(self, path: str | None) -> str | None:
        """The exercise's reference object that the dotted ``path`` reaches, as
        ``module.qualname``: the object itself or anything inside it, under its module or under any
        other module of ``reference`` (a re-export, the Triton op of a torch exercise); else None."""
        if not path or not self.targets:
            return None
        parts = path.split(".")
        if parts[0] != "reference":
            return None
        for module, qualname in self.targets:
            n = len(qualname)
            if any(parts[i:i + n] == qualname for i in range(1, len(parts) - n + 1)):
                return ".".join(module) + "." + ".".join(qualname)
        return None

    def own_reference(self) -> str:
        """The end of a finding on the exercise's own reference: what it is and who decides."""
        return f"the reference's own answer to {self.exercise_id} (the score stands: yours to judge)"

    def flag_reference(self, node: ast.AST, path: str, how: str = "uses") -> None:
        if (hit := self.reference_hit(path)) is not None:
            shown = f" (as {hit})" if hit != path else ""
            self.flag(node, f"{how} {path}{shown}, {self.own_reference()}")

    def class_targets(self, path: str | None) -> list[tuple[str, str]]:
        """(class, method) of each reference that is a method of the class ``path`` reaches (its
        last name is the class's, under ``reference``)."""
        if not path or path.split(".")[0] != "reference":
            return []
        last = path.split(".")[-1]
        return [(q[0], q[1]) for _, q in self.targets if len(q) == 2 and q[0] == last]

    def check_path(self, node: ast.AST, path: str, how: str = "uses") -> None:
        """Findings for a use of the dotted ``path`` (after alias resolution)."""
        self.flag_reference(node, path, how)
        parts = path.split(".")
        if parts[:2] == ["sys", "modules"]:
            self.flag(node, "reads or changes sys.modules, the interpreter's table of loaded modules")
        elif parts[0] in ("importlib", "builtins"):
            self.flag(node, f"uses {parts[0]}")
        elif parts[0] == "os" and len(parts) >= 2 and (parts[1] in OS_CALLS or parts[1].startswith(OS_PREFIXES)):
            self.flag(node, f"uses os.{parts[1]} (processes or files)")
        elif parts[0] == "shutil" and len(parts) >= 2:
            self.flag(node, f"uses shutil.{parts[1]} (files)")
        elif parts[0] == "graders" and len(parts) >= 2 and parts[1] in GRADERS_SUBMODULES:
            self.flag(node, f"reaches into graders.{parts[1]}")
        elif parts[0] == "torch" and len(parts) == 2 and parts[1].endswith("Tensor") and parts[1] != "Tensor":
            self.flag(node, f"uses {path} (a legacy constructor: on the CPU whatever the default device, so the "
                            "grader's default-device case cannot see it; use torch.tensor / torch.zeros with device=)")
        elif parts[0] == "torch" and any(path == p or path.startswith(p + ".") for p in TORCH_BYTES):
            self.flag(node, f"uses {path} (a tensor's bytes outside its methods, past the grader's record of "
                            "host reads)")
        elif parts[0] == "torch" and _torch_machinery(path):
            self.flag(node, f"uses {_torch_machinery(path)} (torch's function modes and defaults, which the "
                            f"grader's own checks use)")

    # -- imports ---------------------------------------------------------------------------------
    def check_import(self, node: ast.AST, module: str) -> None:
        top = module.split(".")[0]
        if top == "graders" and module != "graders":
            self.flag(node, f"imports {module} (an answer needs only `import graders`)")
        elif top in FORBIDDEN_MODULES:
            self.flag(node, f"imports {module}")
        elif _torch_machinery(module):
            self.flag(node, f"uses {_torch_machinery(module)} (torch's function modes and defaults, which the "
                            f"grader's own checks use)")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.module_names.add(a.asname or a.name.split(".")[0])
            self.check_import(node, a.name)
            self.flag_reference(node, a.name, "imports")
            self.imported.add(a.name.split(".")[0])
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                top = a.name.split(".")[0]
                self.aliases[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = "." * node.level + (node.module or "")
        if node.level:
            self.flag(node, f"a relative import (from {module} import ...)")
        for a in node.names:
            full = f"{module}.{a.name}" if module else a.name
            if module == "graders" or module.startswith("graders."):
                self.check_import(node, full)
            elif module.split(".")[0] in FORBIDDEN_MODULES:
                self.check_import(node, module)
            else:
                if a.name == "*":
                    if module in ("os", "shutil", "sys"):
                        self.flag(node, f"imports everything from {module}")
                    if module.split(".")[0] == "reference":
                        self.star_reference.append(module)
                    continue
                self.check_path(node, full, "imports")
            self.imported.add(full.split(".")[0])
            self.aliases[a.asname or a.name] = full

    # -- names and attributes --------------------------------------------------------------------
    def visit_Name(self, node: ast.Name) -> None:
        if (self.star_reference and isinstance(node.ctx, ast.Load) and node.id not in self.bound
                and node.id not in self.aliases):
            for module in self.star_reference:  # from reference.x import *: a bare name may be its
                self.flag_reference(node, f"{module}.{node.id}")
        path = self.name_path(node.id) if isinstance(node.ctx, ast.Load) else None
        if (path is not None and path.split(".")[0] in VALUE_PROTECTED and id(node) not in self.attribute_bases
                and (node.id in self.module_names or (node.id in PREAMBLE_MODULES and node.id not in self.aliases))):
            self.flag(node, f"passes the module {path} around as a value (what is reached through it is not "
                            "checked here)")
        if node.id == "__builtins__":
            self.flag(node, "uses __builtins__")
        elif node.id == "__import__":
            self.flag(node, "uses __import__ (an import the statement form would show)")
        elif node.id in ("exec", "eval", "compile") and isinstance(node.ctx, ast.Load):
            self.flag(node, f"uses {node.id}() (code built at run time is not checked here)")

    def check_attribute_name(self, node: ast.AST, attr: str) -> None:
        """The rules on an attribute's name, reached as ``x.name`` or ``getattr(x, "name")``."""
        if attr in NAMESPACE_ATTRS:
            self.flag(node, f"uses .{attr} (a way to another module's or frame's namespace)")
        elif attr in CODE_ATTRS:
            self.flag(node, f"uses .{attr} (a function's code object: code rebuilt or renamed at run time "
                            f"is not checked here)")
        elif attr in STORAGE_ATTRS:
            self.flag(node, f"uses .{attr}() (a tensor's raw storage: what is read through it bypasses the "
                            f"grader's record of host reads)")

    def is_class_of(self, node: ast.AST) -> bool:
        return _class_of(node) or (isinstance(node, ast.Name) and node.id in self.class_names)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.check_attribute_name(node, node.attr)
        if node.attr == "__dict__" and self.module_rooted(self.root(node.value)):
            self.flag(node, "uses a module's __dict__")
        path = self.resolve(node)
        if path is not None:
            self.check_path(node, path)
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_write_target(node)
        # visit the chain's inner attributes only for their own findings, not their store context
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            self.check_write_target(node)
        # vars(module)["name"], module.__dict__["name"]: the module's attribute of that name
        key = node.slice
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            value, owner = node.value, None
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "vars" \
                    and len(value.args) == 1:
                owner = value.args[0]
            elif isinstance(value, ast.Attribute) and value.attr == "__dict__":
                owner = value.value
            if owner is not None and (root := self.resolve(owner)) is not None:
                self.check_path(node, f"{root}.{key.value}")
        self.generic_visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        """A subclass of a reference class whose method is the exercise's reference, which does
        not define that method (it inherits the reference's) or calls it through ``super()``."""
        for base in node.bases:
            if self.resolve(base) in ("torch.Tensor", "torch.nn.Parameter", "torch.nn.parameter.Parameter"):
                self.flag(node, f"class {node.name} subclasses {self.resolve(base)} (its methods can stand in for "
                                "torch's where the grader reads a result)")
        defined = {b.name for b in node.body if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))} | {
            t.id for b in node.body if isinstance(b, ast.Assign) for t in b.targets if isinstance(t, ast.Name)}
        for base in node.bases:
            path = self.resolve(base)
            for cls, method in self.class_targets(path):
                if method not in defined:
                    self.flag(node, f"class {node.name} inherits {method} from {path}: {method} is "
                                    f"{self.own_reference()}")
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Attribute) and sub.attr == method and isinstance(sub.value, ast.Call)
                            and isinstance(sub.value.func, ast.Name) and sub.value.func.id == "super"):
                        self.flag(sub, f"calls super().{method}, that is {path}.{method}, {self.own_reference()}")
        self.generic_visit(node)

    def check_write_target(self, target: ast.AST) -> None:
        """An assignment or ``del`` of an attribute or item: flag writes into a module's namespace, and
        into a class reached through ``type(x)`` or ``x.__class__`` (``type(t).__eq__ = ...`` patches
        torch.Tensor for every tensor of the process)."""
        base = target.value if isinstance(target, (ast.Attribute, ast.Subscript)) else target
        if isinstance(target, ast.Attribute) and self.is_class_of(base) and _patchable(target.attr):
            self.flag(target, f"assigns {target.attr} on a class reached through type() or __class__ (a patch of "
                              "torch.Tensor's methods or of a special method)")
            return
        if isinstance(target, ast.Subscript) and _namespace_call(base):
            self.flag(target, f"writes into {base.func.id}() (module globals)")
            return
        root = self.root(base)
        if self.module_rooted(root):
            what = ast.unparse(target) if hasattr(ast, "unparse") else "an attribute"
            verb = "deletes" if isinstance(target.ctx, ast.Del) else "assigns"
            self.flag(target, f"{verb} {what} on the imported module {root} (a patch)")

    # -- assignments (aliases) and calls ---------------------------------------------------------
    def imported_by_call(self, node: ast.AST) -> str | None:
        """The module a call imports by a constant name: ``importlib.import_module("a.b")`` gives
        ``a.b``, ``__import__("a.b")`` gives ``a`` (``a.b`` with a ``fromlist``); else None."""
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            return None
        func = self.resolve(node.func) if isinstance(node.func, (ast.Name, ast.Attribute)) else None
        if func not in _IMPORT_CALLS:
            return None
        name = node.args[0].value
        if func == "importlib.import_module":
            return name
        fromlist = node.args[3] if len(node.args) > 3 else next(
            (kw.value for kw in node.keywords if kw.arg == "fromlist"), None)
        return name if fromlist is not None else name.split(".")[0]

    def visit_Assign(self, node: ast.Assign) -> None:
        path = self.resolve(node.value) if isinstance(node.value, (ast.Name, ast.Attribute)) else None
        if path is None and (module := self.imported_by_call(node.value)) is not None:
            path = module  # m = importlib.import_module("reference.x"): m is that module
            self.imported.add(module.split(".")[0])
        for t in node.targets:
            if isinstance(t, ast.Name) and _class_of(node.value):
                self.class_names.add(t.id)
            if isinstance(t, ast.Name):
                if self.module_rooted(path):
                    self.aliases[t.id] = path
                    for cls, method in self.class_targets(path):
                        self.flag(node, f"binds {t.id} to {path}, whose {method} is {self.own_reference()}")
                else:
                    self.aliases.pop(t.id, None)
        self.generic_visit(node)

    def visit_With(self, node: ast.With) -> None:
        for item in node.items:
            call = item.context_expr
            if isinstance(call, ast.Call) and self.resolve(call.func) == "torch.device":
                self.flag(node, "enters torch.device(...) as a context (it sets the default device, which a "
                                "grader's case sets)")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if self.imported_by_call(node) is not None:
            name = node.args[0].value
            self.flag_reference(node, name, "imports")
            fromlist = node.args[3] if len(node.args) > 3 else next(
                (kw.value for kw in node.keywords if kw.arg == "fromlist"), None)
            if isinstance(fromlist, (ast.List, ast.Tuple)):
                for item in fromlist.elts:
                    if isinstance(item, ast.Constant) and isinstance(item.value, str):
                        self.flag_reference(node, f"{name}.{item.value}", "imports")
        if isinstance(func, ast.Name):
            if func.id in ("setattr", "delattr") and node.args:
                root = self.root(node.args[0])
                if self.module_rooted(root):
                    self.flag(node, f"calls {func.id}() on the imported module {root} (a patch)")
                elif self.is_class_of(node.args[0]):
                    name = node.args[1] if len(node.args) > 1 else None
                    if not (isinstance(name, ast.Constant) and isinstance(name.value, str)) or _patchable(name.value):
                        self.flag(node, f"calls {func.id}() on a class reached through type() or __class__ (a patch)")
            elif func.id == "getattr" and len(node.args) >= 2:
                root = self.root(node.args[0])
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    self.check_attribute_name(node, name.value)
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and root is not None:
                    self.check_path(node, f"{root}.{name.value}")
                elif root is not None and root.split(".")[0] in {"sys", "os", "builtins", "graders", "reference",
                                                                  "importlib", "shutil", "torch"}:
                    self.flag(node, f"getattr() on {root} with a name computed at run time")
            elif func.id == "open":
                self.check_open(node, mode_index=1)
        elif isinstance(func, ast.Attribute):
            if _namespace_call(func.value) and func.attr in {"update", "setdefault", "pop", "__setitem__",
                                                              "__delitem__", "clear", "popitem"}:
                self.flag(node, f"changes {func.value.func.id}() (module globals)")
            elif func.attr in ("write_text", "write_bytes"):
                self.flag(node, f"writes a file (.{func.attr})")
            elif func.attr == "open" and self.resolve(func) in ("io.open", "codecs.open"):
                self.check_open(node, mode_index=1)
            elif func.attr == "open" and self.resolve(func) != "os.open" and not isinstance(func.value, ast.Call):
                # pathlib.Path.open(mode)
                self.check_open(node, mode_index=0)
            elif self.resolve(func) == "os.open":
                self.flag(node, "uses os.open (files)")
        self.generic_visit(node)

    def check_open(self, node: ast.Call, mode_index: int) -> None:
        mode = node.args[mode_index] if len(node.args) > mode_index else None
        for kw in node.keywords:
            if kw.arg == "mode":
                mode = kw.value
        if mode is None:
            return
        if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
            if _WRITE_MODE_CHARS & set(mode.value):
                self.flag(node, f"opens a file for writing (mode {mode.value!r})")
        else:
            self.flag(node, "opens a file with a mode computed at run time")


def _namespace_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in {"globals", "locals", "vars"} and not node.args)


def _class_of(node: ast.AST) -> bool:
    """``type(x)`` or ``x.__class__``: an expression that gives some object's class."""
    return ((isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"
             and len(node.args) == 1) or (isinstance(node, ast.Attribute) and node.attr == "__class__"))


def _patchable(attr: str) -> bool:
    """A special method, or a name torch.Tensor has: set on a class an answer reached through
    ``type(t)``, it changes every tensor of the process (``type(t).__eq__``, ``T.untyped_storage``)."""
    import torch

    return attr.startswith("__") or hasattr(torch.Tensor, attr)
