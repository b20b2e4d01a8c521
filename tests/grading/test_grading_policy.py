"""The source policy (labkit.grading.policy) and the pinned assignment (labkit.grading.assignments).

Static tests first (each attack of issue 16 is refused with its cell and line; honest code
and every solution notebook keep the rules), then the grader end to end on notebook 01:
the assignment pinned by ``--assignment``, check cells deleted, another notebook uploaded,
two notebooks in one file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from labkit.grading.assignments import ANSWERS, grading_points
from labkit.grading.policy import check_cells
from labkit.grading.registry import all_exercises, exercises_for_notebook

ROOT = Path(__file__).resolve().parents[2]


def _shipped(major: str) -> list[str]:
    nb = json.loads(next((ROOT / "notebooks").glob(f"{major}_*.ipynb")).read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _v(ex, answer, *cells):
    return check_cells(ex, answer, [(f"cell {i + 1}", src) for i, src in enumerate(cells)])


_SETUP09 = next(c for c in _shipped("09") if "import route" in c or ", route," in c)

ATTACKS = {  # name: (exercise, answer name, cells, what the violation names)
    "grader's expected-value code": ("8.6", "axis_bytes", [
        "from labkit.grading.exercises.nb08_3d_parallelism import _axis\naxis_bytes = _axis"],
        "import from `labkit.grading.exercises.nb08_3d_parallelism`"),
    "FunctionType copy of the reference": ("2.1", "gpipe_actions", [
        "import types\nfrom labkit.pipeline import schedules",
        "gpipe_actions = types.FunctionType(schedules.gpipe_schedule.__code__, {})"], "`.FunctionType`"),
    "__code__ restored inside the call": ("2.1", "gpipe_actions", [
        "def gpipe_actions(K, M):\n    f.__code__ = saved\n    return f(K, M)"], "`.__code__`"),
    "importlib.reload": ("2.1", "gpipe_actions", [
        "import importlib, labkit.pipeline.schedules as s\nimportlib.reload(s)"], "import of `importlib`"),
    "exec(inspect.getsource(...))": ("1.1", "bubble_fraction", [
        "import inspect\nfrom labkit.pipeline import simulate\nexec(inspect.getsource(simulate.bubble_fraction))"],
        "`exec`"),
    "the reference in a subprocess": ("1.1", "bubble_fraction", [
        "import subprocess\ndef bubble_fraction(K, M):\n    return float(subprocess.check_output(['python', '-c', "
        "'...']))"], "import of `subprocess`"),
    "os.system": ("1.1", "bubble_fraction", ["import os as o\no.system('true')"], "`os.system`"),
    "from os import fork": ("1.1", "bubble_fraction", ["from os import fork"], "import of `os.fork`"),
    "sys.modules": ("1.1", "bubble_fraction", ["import sys\nm = sys.modules['labkit.pipeline.simulate']"],
                    "`sys.modules`"),
    "gc": ("1.1", "bubble_fraction", ["import gc"], "import of `gc`"),
    "ctypes": ("1.1", "bubble_fraction", ["import ctypes"], "import of `ctypes`"),
    "eval of a string": ("1.1", "bubble_fraction", ["def bubble_fraction(K, M):\n    return eval('(K-1)/(M+K-1)')"],
                         "`eval`"),
    "shell escape": ("1.1", "bubble_fraction", ["!python -c 'print(1)'"], "`get_ipython`"),
    "cell magic": ("1.1", "bubble_fraction", ["%%bash\necho hi"], "`get_ipython`"),
    "collective through the process-group object": ("0.2", "ring_all_reduce", [
        "def ring_all_reduce(ctx, x):\n    ctx.group.allreduce([x]).wait()\n    return x"], "`.allreduce`"),
    "collective through an alias bound before the case": ("0.2", "ring_all_reduce", [
        "import torch.distributed as dist\nar = dist.all_reduce",
        "def ring_all_reduce(ctx, x):\n    ar(x, group=ctx.group)\n    return x"], "`.all_reduce`"),
    "collective imported by name": ("0.2", "ring_all_reduce", [
        "from torch.distributed import all_reduce as go",
        "def ring_all_reduce(ctx, x):\n    go(x)\n    return x"], "`go`"),
    "the reference under another name": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank as c\ndef axis_bytes(*a):\n    return c(*a)"], "`c`"),
    "the reference through a module attribute": ("1.1", "bubble_fraction", [
        "import labkit.pipeline.simulate as S",
        "def bubble_fraction(K, M):\n    return S.bubble_fraction(K, M)"], "`.bubble_fraction`"),
    "a table of the reference's values built at the top level": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank",
        "T = {k: comm_per_rank(*k) for k in [(1, 2), (3, 4)]}",
        "def axis_bytes(*a):\n    return T[a]"], "`comm_per_rank`"),
    "a table filled by a helper": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank\ncache = {}",
        "def fill(c):\n    c[1] = comm_per_rank(1)",
        "fill(cache)",
        "def axis_bytes(*a):\n    return cache[a]"], "`comm_per_rank`"),
    "a table built while a helper still meant the reference": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank as h",
        "def helper(k):\n    return h(k)",
        "T = {k: helper(k) for k in range(3)}",
        "def h(k):\n    return 0",
        "def axis_bytes(k):\n    return T[k]"], "`h`"),
    "a table filled in several steps": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank\ncache = {}",
        "cache.update({k: comm_per_rank(k) for k in range(3)})",
        "cache[99] = 0",
        "def axis_bytes(k):\n    return cache[k]"], "`comm_per_rank`"),
    "getattr with a computed name": ("1.1", "bubble_fraction", [
        "import labkit.pipeline.simulate as S\nname = 'bubble_' + 'fraction'",
        "def bubble_fraction(K, M):\n    return getattr(S, name)(K, M)"], "`getattr` with a computed name"),
    "the reference in check's expression": ("1.1", "bubble_fraction", [
        "from labkit.pipeline.simulate import bubble_formula",
        "check('1.1', lambda K, M: bubble_formula(K, M))"], "`bubble_formula`"),
    "patching torch.distributed": ("0.2", "ring_all_reduce", [
        "import torch.distributed as dist\ndist.all_reduce = lambda *a, **k: None"], "assigning `dist.all_reduce`"),
    "patching through an alias": ("0.2", "ring_all_reduce", [
        "import torch\nd = torch.distributed\nd.send = print"], "assigning `d.send`"),
    "patching a labkit class": ("6.4", "row_parallel_linear", [
        "from labkit.tensor_parallel.layers import ColumnParallelLinear\nColumnParallelLinear.forward = None"],
        "assigning `ColumnParallelLinear.forward`"),
    "setattr on a module": ("1.1", "bubble_fraction", [
        "import labkit.pipeline.simulate as S\nsetattr(S, 'bubble_fraction', None)"], "`setattr(S, ...)`"),
    "patching the class of an object": ("1.1", "bubble_fraction", ["x = 1\ntype(x).real = 2"], "assigning"),
    "patching builtins": ("1.1", "bubble_fraction", ["print.x = 1"], "assigning `print.x`"),
    "star import from labkit": ("1.1", "bubble_fraction", ["from labkit.pipeline.simulate import *"],
                                "`from labkit.pipeline.simulate import *`"),
    "labkit.grading.runner": ("1.1", "bubble_fraction", ["import labkit.grading.runner as R\nR.evaluate = None"],
                              "import from `labkit.grading.runner`"),
    "labkit.grading as a name": ("1.1", "bubble_fraction", ["from labkit import grading"],
                                 "import from `labkit.grading`"),
    # code the policy cannot read: only modules on the allow-list may be imported
    "a module the notebook writes to disk": ("1.1", "bubble_fraction", [
        "open('helper.py', 'w').write('from labkit.pipeline.simulate import bubble_fraction as f')\nimport helper",
        "def bubble_fraction(K, M):\n    return helper.f(K, M)"], "import of `helper`"),
    "a package not on the list": ("1.1", "bubble_fraction", ["import scipy.special"], "import of `scipy.special`"),
    "a torch part not on the list": ("1.1", "bubble_fraction", ["from torch.utils import cpp_extension"],
                                     "import of `torch.utils`"),
    "a relative import": ("1.1", "bubble_fraction", ["from . import helper"], "`from . import ...`"),
    "sys.path": ("1.1", "bubble_fraction", ["import sys\nsys.path.insert(0, '/tmp')"], "`sys.path`"),
    "torch.hub from a folder": ("1.1", "bubble_fraction", [
        "import torch\nf = torch.hub.load('.', 'f', source='local')"], "`.hub`"),
    "unpickling": ("1.1", "bubble_fraction", ["import torch\nf = torch.load('f.pt', weights_only=False)"],
                   "`weights_only=False`"),
    "callers' frames": ("1.1", "bubble_fraction", [
        "import inspect\ndef bubble_fraction(K, M):\n    return inspect.getargvalues(inspect.stack()[1][0]).locals"],
        "`inspect.stack`"),
    # code torch would run in the ranks although no answer calls it (outside every answer's closure)
    "a torch function mode entered at the top level": ("0.2", "ring_all_reduce", [
        "import torch\nclass Spy(torch.overrides.TorchFunctionMode):\n"
        "    def __torch_function__(self, f, types, args=(), kwargs=None):\n        return f(*args, **(kwargs or {}))\n"
        "def keep():\n    with Spy():\n        yield\nit = keep()\nnext(it)"], "`torch.overrides`"),
    "a global module hook": ("13.1", "split_linear_backward", [
        "import torch\ntorch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)"],
        "`.register_module_forward_hook`"),
    # 0.2: the ranks talk only through send/recv (the relay), not through files, pipes, stores, shared memory
    "ring data through files": ("0.2", "ring_all_reduce", [
        "import torch",
        "def ring_all_reduce(ctx, x):\n    torch.save(x, f'/tmp/r{ctx.rank}')\n    return x"], "`.save`"),
    "ring data through open()": ("0.2", "ring_all_reduce", [
        "def ring_all_reduce(ctx, x):\n    open(f'/tmp/r{ctx.rank}', 'w').write(str(x.tolist()))\n    return x"],
        "`open`"),
    "ring data through a process group of its own": ("0.2", "ring_all_reduce", [
        "import torch.distributed as dist",
        "def ring_all_reduce(ctx, x):\n    dist.init_process_group('gloo', init_method='file:///tmp/pg', "
        "rank=ctx.rank, world_size=ctx.world_size)\n    return x"], "`.init_process_group`"),
    "ring data through a pipe": ("0.2", "ring_all_reduce", [
        "import os\nfds = os.pipe()", "def ring_all_reduce(ctx, x):\n    os.write(fds[1], b'1')\n    return x"],
        "`os` (from `os`)"),
    "ring data through shared memory made before the ranks fork": ("0.2", "ring_all_reduce", [
        "import torch\nboard = torch.zeros(4, 16).share_memory_()",
        "def ring_all_reduce(ctx, x):\n    board[ctx.rank] = x\n    return board.sum(0)"], "`.share_memory_`"),
    # 13.1: the returned gradients cannot show a .grad cleared before a .backward(): refused in its code
    ".grad cleared, then .backward()": ("13.1", "split_linear_backward", [
        "def split_linear_backward(layer, x, grad_out):\n    x.grad = layer.weight.grad = layer.bias.grad = None\n"
        "    layer(x).backward(grad_out)\n    return x.grad, layer.weight.grad, layer.bias.grad"], "`.backward`"),
    "zero_grad, then torch.autograd.backward": ("13.1", "split_linear_backward", [
        "import torch",
        "def split_linear_backward(layer, x, grad_out):\n    layer.zero_grad()\n"
        "    torch.autograd.backward(layer(x), grad_out, inputs=[x, layer.weight, layer.bias])\n"
        "    return tuple(t.grad for t in (x, layer.weight, layer.bias))"], "`.zero_grad`"),
    # a red-team's second round (labkit/grading/reach.py: labkit functions that run the reference)
    "a labkit function that runs the reference (build_schedule)": ("2.1", "gpipe_actions", [
        "from labkit.pipeline.explorer import build_schedule",
        "def gpipe_actions(K, M):\n    return build_schedule('GPipe', K, M)"],
        "build_schedule (labkit.pipeline.explorer) runs labkit's own"),
    "a labkit function that runs the reference, through a module alias": ("14.1", "pack_groups", [
        "import labkit.moe.eplb as E",
        "def pack_groups(loads, n_nodes):\n    return E.rebalance_experts(loads, 4, 4, n_nodes, n_nodes)"],
        "rebalance_experts (labkit.moe.eplb) runs labkit's own balanced_packing"),
    "an autograd Function whose apply calls labkit's column-parallel linears": ("6.2", "CopyToRegion", [
        "import torch\nfrom labkit.tensor_parallel.layers import column_parallel_linears",
        "class CopyToRegion(torch.autograd.Function):\n    @staticmethod\n    def apply(x, group):\n"
        "        return column_parallel_linears(x, [], group)[0]"], "column_parallel_linears"),
    # principle 3 as written: the reference named in ANY cell before the grading point (a second red team
    # hid it in a global set inside a function, a container filled by a function, an alias of a container,
    # an if/while/try block, an exception's args; the answer's closure never saw it)
    "the reference imported in an earlier cell, used outside the answer": ("8.6", "axis_bytes", [
        "from labkit.plan.comm import comm_per_rank\nWIDTH = 4", "def axis_bytes(t, p, d):\n    return t * WIDTH",
        "print(comm_per_rank(1))"], "cell 3, line 1: `comm_per_rank`"),  # the import is the kit's own statement
    "a global set inside a function that imports the reference": ("1.1", "bubble_fraction", [
        "def _fill():\n    global _f\n    from labkit.pipeline.simulate import bubble_formula as g\n"
        "    _f = g\n_fill()",
        "def bubble_fraction(K, M):\n    return float(_f(K, M))"], "import of `bubble_formula`"),
    "the reference carried out in an exception": ("16.1", "merge_attention_partials", [
        "try:\n    from labkit.context_parallel.blockwise import merge_partials as _m\n    raise KeyError(_m)\n"
        "except KeyError as _e:\n    _f = _e.args[0]", "def merge_attention_partials(*a):\n    return _f(*a)"],
        "import of `merge_partials`"),
    "the reference through a module alias in a while block": ("10.1", "switch_loss", [
        "while True:\n    import labkit.moe.losses as L\n    break",
        "def switch_loss(*a):\n    return L.switch_aux_loss(*a)"], "`L.switch_aux_loss`"),
    "the ModelSpec's own parameter count": ("9.3", "moe_param_count", [
        "def moe_param_count(spec):\n    return int(spec.total_params()), int(spec.active_params())"],
        "`.total_params`"),
    "getattr bound to another name": ("2.1", "gpipe_actions", [
        "import labkit.pipeline.schedules as S\n_ga = getattr",
        "def gpipe_actions(K, M):\n    return _ga(S, 'gp' + 'ipe_schedule')(K, M)"], "`getattr` used as a value"),
    "getattr of a module through another module": ("12.1", "n_combinations", [
        "import os\nmods = getattr(os, 'sys')"], "`getattr(..., 'sys')`"),
    "a module through another module's attribute": ("12.1", "n_combinations", [
        "import os\nb = os.sys.modules['builtins']"], "`.sys`"),
    "a module's attribute assigned through a loop variable": ("14.3", "inter_node_bytes", [
        "import torch\nfor _m in (torch,):\n    _m.allclose = lambda *a, **k: True"], "assigning `_m.allclose`"),
    "a module's attribute assigned through a function's parameter": ("14.3", "inter_node_bytes", [
        "import torch\ndef patch(m):\n    m.allclose = lambda *a, **k: True\npatch(torch)"],
        "assigning `m.allclose`"),
    "a staticmethod's first parameter is not self": ("14.3", "inter_node_bytes", [
        "import torch\nclass P:\n    @staticmethod\n    def go(ctx, m):\n        m.allclose = None\nP.go(None, torch)"],
        "assigning `m.allclose`"),
    # a third red team: a module used as a value hides which of its attributes the code reaches (the reference
    # reached outside the answer's closure and stored where the answer reads it; sys.modules through an alias)
    "a module handed to getattr in a helper that fills a global": ("13.1", "split_linear_backward", [
        "import torch\nimport labkit.pipeline.split_backward as sb\nclass B:\n    pass\nbox = B()",
        "def fill(m):\n    box.f = getattr(m, 'backward_' + 'input')\nfill(sb)",
        "def split_linear_backward(layer, x, g):\n    return box.f(layer(x), x, g, [])"], "`sb` used as a value"),
    "the reference by getattr with a written name, outside the answer": ("13.1", "split_linear_backward", [
        "import labkit.pipeline.split_backward as sb\nclass B:\n    pass\nbox = B()",
        "def fill():\n    box.f = getattr(getattr(sb, 'backward_input'), '__call__')\nfill()"],
        "`getattr(sb, 'backward_input')`"),
    "a module in a container": ("13.1", "split_linear_backward", [
        "import labkit.pipeline.split_backward as sb\ndef fill():\n    return [sb][0].backward_input"], "`sb` used"),
    "a module through a loop variable in a function": ("13.1", "split_linear_backward", [
        "import labkit.pipeline.split_backward as sb\ndef fill():\n    for m in (sb,):\n        return dir(m)"],
        "`sb` used as a value"),
    "sys.modules through an alias": ("12.1", "n_combinations", [
        "import sys\nt = sys\nm = t.modules['labkit.pipeline.split_backward']"], "`sys` used as a value"),
    "a module's attribute chain to a module, stored": ("12.1", "n_combinations", [
        "import labkit\nm = getattr(labkit, 'pipeline').split_backward"], "used as a value"),
    "attributes looked up by a format field": ("9.3", "moe_param_count", [
        "import string\ndef moe_param_count(spec):\n    return string.Formatter().get_field('0.total_' + 'params', "
        "(spec,), {})[0]()"], "`.get_field`"),
    # code from strings: annotation strings evaluated, unpickling switched on by a value the policy cannot read
    "an annotation string evaluated by get_type_hints": ("13.1", "split_linear_backward", [
        "import typing\ndef _h(x: \"__import__('os')\"):\n    pass\nf = typing.get_type_hints(_h)['x']"],
        "`.get_type_hints`"),
    "an annotation string evaluated by singledispatch": ("12.1", "n_combinations", [
        "from functools import singledispatch"], "import of `singledispatch`"),
    "an annotation string evaluated by inspect.signature": ("12.1", "n_combinations", [
        "import inspect\ndef g(x: 'print(1)'):\n    pass\ninspect.signature(g, eval_str=1)"], "`eval_str=1`"),
    "numpy's allow_pickle as its third positional argument": ("13.1", "split_linear_backward", [
        "import numpy as np\nf = np.load('/tmp/p.bin', None, True)"], "with more positional arguments"),
    "allow_pickle as a value the policy cannot read": ("12.1", "n_combinations", [
        "import numpy as np\nf = np.load('p', allow_pickle=not 0)"], "`allow_pickle=not 0`"),
    "weights_only as a falsy list": ("12.1", "n_combinations", [
        "import torch\nf = torch.load('p', weights_only=[])"], "`weights_only=[]`"),
    "torch.load left to the environment": ("12.1", "n_combinations", [
        "import torch, os\nos.environ['TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD'] = '1'\nf = torch.load('p')"],
        "without weights_only=True"),
    "numpy's load in a partial": ("12.1", "n_combinations", [
        "import functools, numpy as np\nf = functools.partial(np.load, 'p', None, True)()"], "used as a value"),
    "numpy's read_array with allow_pickle positional": ("12.1", "n_combinations", [
        "import numpy as np\nf = np.lib.format.read_array(open('p', 'rb'), True)"], "with more positional"),
    "torch's object unpickler": ("12.1", "n_combinations", [
        "import torch.distributed as d\nf = d.distributed_c10d._tensor_to_object(None, 1, None)"],
        "`._tensor_to_object`"),
    "torch.package": ("12.1", "n_combinations", [
        "import torch\nI = torch.package.PackageImporter('x')"], "`torch.package`"),
    # refused modules and builtins under another name: private names of allowed modules, and public paths judged
    # on the object they reach
    "sys.modules through a module's private alias of sys": ("13.1", "split_linear_backward", [
        "import collections\nf = collections._sys.modules['labkit.pipeline.split_backward'].backward_input"],
        "`collections._sys` (a private name of a module you did not write"),
    "exec through a module's alias of builtins": ("12.1", "n_combinations", [
        "import enum\nenum.bltns.exec('import subprocess')"], "`enum.bltns` (reaches builtins"),
    "pickle's Unpickler under torch's name": ("12.1", "n_combinations", [
        "import torch.distributed as d\nf = d.distributed_c10d._unpickler(open('/tmp/p', 'rb')).load()"],
        "`d.distributed_c10d._unpickler` (a private name"),
    "os.system through a module's alias of os": ("12.1", "n_combinations", [
        "import tempfile\ntempfile._os.system('true')"], "`tempfile._os` (a private name"),
    # a name a package exports lazily (PEP 562 __getattr__) is judged where its object was defined
    "the reference through a package's lazy export": ("4.1", "layers_of_rank", [
        "import labkit.pipeline\nclass B:\n    pass\nbox = B()\ndef fill():\n"
        "    box.f = labkit.pipeline.gpt_stages_for_rank\nfill()"], "`labkit.pipeline.gpt_stages_for_rank`"),
    "a launderer through a package's lazy export": ("13.2", "zb_h1_order", [
        "def fill():\n    from labkit.pipeline import ScheduleZBH1 as S\n    return S"], "import of `ScheduleZBH1`"),
    # a module object reached from a value that is not one: a builtin's module, an AttributeError's object,
    # inspect.getmodule; private helpers of allowed modules (torch._utils._import_dotted_name imports by name)
    "builtins through a builtin's __self__": ("12.1", "n_combinations", [
        "b = len.__self__\nb.exec('import subprocess')"], "`.__self__`"),
    "a module from an AttributeError": ("13.1", "split_linear_backward", [
        "import labkit.pipeline.split_backward as sb\ntry:\n    sb.nothing\nexcept AttributeError as e:\n"
        "    m = e.obj\nf = getattr(m, 'backward_' + 'input')"], "`.obj`"),
    "a module from inspect.getmodule": ("13.1", "split_linear_backward", [
        "import inspect\nimport labkit.pipeline.split_backward as sb\nm = inspect.getmodule(sb.backward_weight)"],
        "`.getmodule`"),
    "torch's private importer by dotted name": ("12.1", "n_combinations", [
        "import torch\nf = torch._utils._import_dotted_name('labkit.pipeline.split_backward.backward_input')"],
        "`torch._utils` (a private name of a module you did not write"),
    "a private module imported by name": ("12.1", "n_combinations", ["from torch import _utils"],
                                          "import of `_utils` (a private name"),
    "a getattr of its own hands the module on, then the builtin comes back": ("13.1", "split_linear_backward", [
        "import labkit.pipeline.split_backward as sb\nclass B:\n    pass\nbox = B()",
        "def getattr(m, n):\n    return m\nbox.m = getattr(sb, 'zzz')\ndel getattr",
        "def fill():\n    box.f = getattr(box.m, 'backward_' + 'input')\nfill()"], "rebinding `getattr`"),
    "a ModelSpec method by a computed name through inspect": ("9.3", "moe_param_count", [
        "import inspect\ndef moe_param_count(spec):\n"
        "    return dict(inspect.getmembers_static(type(spec)))['total_' + 'params'](spec)"], "`.getmembers_static`"),
    "a parameter of the module's name rebound by an import inside": ("13.1", "split_linear_backward", [
        "def fill(sb):\n    import labkit.pipeline.split_backward as sb\n    return [sb]"], "`sb` used as a value"),
    "a loop variable of the module's name rebound by an import in the loop": ("13.1", "split_linear_backward", [
        "for sb in range(1):\n    import labkit.pipeline.split_backward as sb\n    box = [sb]"],
        "`sb` used as a value"),
    "labkit.grading through an attribute path": ("12.1", "n_combinations", [
        "import labkit.pipeline\nlabkit.grading.kernel.register('12.1', print)"],
        "`labkit.grading` (the grader's code"),
    # the kernel's shell runs code from strings that no cell shows
    "the kernel's shell through IPython's attributes": ("13.1", "split_linear_backward", [
        "import IPython.display\nsh = IPython.core.interactiveshell.InteractiveShell.instance()\n"
        "sh.run_cell('from labkit.pipeline.split_backward import backward_input')"],
        "`IPython.core` (reaches the kernel's machinery"),
    "the kernel's shell held by exit": ("12.1", "n_combinations", ["exit._ip.ex('import subprocess')"], "`._ip`"),
    "the kernel's shell through a widget's comm": ("12.1", "n_combinations", [
        "import ipywidgets\nipywidgets.IntSlider().comm.kernel.shell.ev('1')"], "`.kernel`"),
    "the kernel's machinery under another module's name": ("12.1", "n_combinations", [
        "import ipywidgets\nc = ipywidgets.comm.comm.create_comm"], "`ipywidgets.comm.comm` (reaches the kernel's"),
    # a red team's: a shipped cell imports the reference; a def of its name nested in a function that never
    # runs, and an alias of the container the answer reads, hid it (9.1-9.3 scored 9 of 9 with no answer code)
    "a nested def of the reference's name clears nothing": ("9.1", "top_k_gate", [
        _SETUP09, "def _decoy():\n    def route():\n        pass\nB = []\nA = B\nA.append(route)",
        "def top_k_gate(logits, k, renormalize=False):\n    return B[0](logits, k, 'softmax', renormalize)[:2]"],
        "`route`"),
    "the reference kept before a top-level def of its name": ("9.1", "top_k_gate", [
        _SETUP09, "B = [route]", "def route():\n    pass",
        "def top_k_gate(logits, k, renormalize=False):\n    return B[0](logits, k, 'softmax', renormalize)[:2]"],
        "`route`"),
    # a red team's: labkit functions that compute the answer without calling a listed reference
    "the planner's FSDP formula as 15.4's answer": ("15.4", "gathered_peak", [
        "from labkit.data_parallel.fsdp import expected_fsdp\ndef gathered_peak(units, d, reshard):\n"
        "    return expected_fsdp(units, d, reshard, bytes_per_element=1)['peak_gathered_bytes']"],
        "import of `expected_fsdp`"),
    "the planner's layer chunks as 4.1's answer": ("4.1", "layers_of_rank", [
        "from labkit.plan.memory import rank_chunks\ndef layers_of_rank(n_layers, K, v, rank):\n"
        "    return [i for c in rank_chunks(n_layers, K, v, rank) for i in c]"], "import of `rank_chunks`"),
    "the zero-bubble formulas as 13.3's answer": ("13.3", "bubble_time", [
        "from labkit.pipeline.zero_bubble import bubble_time_formula as f\ndef bubble_time(s, K, a, b, c):\n"
        "    return f(s, K, a, b, c)"], "import of `bubble_time_formula`"),
    # a backend name imports a module matplotlib finds on the path (one written to disk, or any package)
    "matplotlib.use with a computed backend": ("1.1", "bubble_fraction", [
        "import matplotlib\nmatplotlib.use('mod' + 'ule://mine')"], "`matplotlib.use`"),
    "pyplot.switch_backend": ("1.1", "bubble_fraction", [
        "import matplotlib.pyplot as plt\nplt.switch_backend('module://mine')"], "`plt.switch_backend`"),
    "use imported by name": ("1.1", "bubble_fraction", ["from matplotlib import use as u\nu('module://mine')"],
                             "import of `matplotlib.use`"),
    # a fifth red team's: attribute names the rules never saw as attributes
    "a class pattern reads __globals__ and the reference": ("1.1", "bubble_fraction", [
        "from labkit.grading import check",
        "def bubble_fraction(K, M):\n    match check:\n"
        "        case object(__globals__={'__builtins__': {'__import__': imp}}):\n            pass\n"
        "    match imp('labkit.pipeline.simulate', fromlist=['x']):\n"
        "        case object(bubble_formula=f):\n            pass\n    return float(f(K, M))"],
        "a class pattern"),
    "a Formatter subclass catches what a format string looks up": ("1.1", "bubble_fraction", [
        "import string\nfrom labkit.grading import check",
        "class Grab(string.Formatter):\n    def format_field(self, value, spec):\n"
        "        self.seen.append(value)\n        return ''",
        "def bubble_fraction(K, M):\n    g = Grab()\n    g.seen = []\n"
        "    g.format('{0.__globals__[__builtins__]}', check)\n    return 0.0"], "`string.Formatter`"),
    "a built-up getattr name stored through a call": ("1.1", "bubble_fraction", [
        "from labkit.grading import check\n_B = []\ndef store():\n    return _B",
        "store().append(getattr(check, '__glo' + 'bals__'))",
        "def bubble_fraction(K, M):\n    return float(store()[0]['x'](K, M))"], "`getattr` with a computed name"),
    "getattr_static with a built-up name": ("1.1", "bubble_fraction", [
        "import inspect\nfrom labkit.grading import check",
        "def bubble_fraction(K, M):\n    return inspect.getattr_static(check, '__glo' + 'bals__')"],
        "getattr_static"),
    "a private attribute of a kit class through an alias": ("5.1", "segment_boundaries", [
        "from labkit.pipeline import ScheduleGPipe", "S = ScheduleGPipe",
        "def segment_boundaries(n, k):\n    return S._builder(n, k)"], "`S._builder`"),
    # a sixth red team's: frames, evaluated annotation strings, private names past a subscript, kit objects
    "inspect.signature with eval_str passed as **": ("1.1", "bubble_fraction", [
        "import inspect",
        "def probe(x: \"__import__('labkit.pipeline.simulate', fromlist=['x']).bubble_formula\"):\n    pass\n"
        "opts = {'eval_str': True}\nformula = inspect.signature(probe, **opts).parameters['x'].annotation",
        "def bubble_fraction(K, M):\n    return float(formula(K, M))"], "`inspect.signature`"),
    "a coroutine's frame's builtins": ("1.1", "bubble_fraction", [
        "async def idle():\n    return None\nco = idle()\nB = co.cr_frame.f_builtins\nco.close()",
        "def bubble_fraction(K, M):\n    return 0.0"], "`.cr_frame`"),
    "a signal handler's frame's builtins": ("1.1", "bubble_fraction", [
        "import signal\nseen = []\ndef grab(signum, frame):\n    seen.append(frame.f_builtins)",
        "def bubble_fraction(K, M):\n    return 0.0"], "`.f_builtins`"),
    "a forward reference evaluated through a private method": ("1.1", "bubble_fraction", [
        "import typing\nref = typing.List[\"__import__('labkit.pipeline.simulate').x\"].__args__[0]\n"
        "formula = ref._evaluate({}, {}, frozenset())",
        "def bubble_fraction(K, M):\n    return float(formula(K, M))"], "_evaluate`"),
    "the router of a MoELayer a kit cell made": ("9.1", "top_k_gate", [
        *_shipped("09")[1:3],
        "def top_k_gate(logits, k, renormalize=False):\n    out = layer.router(logits)\n"
        "    return out.weights, out.indices",
        "check('9.1', top_k_gate)"], "`MoELayer`"),
    "a builtin a kit cell calls, redefined to catch its objects": ("9.1", "top_k_gate", [
        *_shipped("09")[1:2],
        "captured = []\ndef sum(values, start=0):\n    captured.append(values)\n    return 0",
        *_shipped("09")[2:3],
        "def top_k_gate(logits, k, renormalize=False):\n    return captured[0]",
        "check('9.1', top_k_gate)"], "`sum`"),
    "a generator's locals": ("1.1", "bubble_fraction", [
        "import inspect\ng = (x for x in [1])\nL = inspect.getgeneratorlocals(g)",
        "def bubble_fraction(K, M):\n    return 0.0"], "`inspect.getgeneratorlocals`"),
    # a seventh red team's: a module bound as a class attribute, a compiler torch.compile starts
    "a kit module imported in a class body": ("1.1", "bubble_fraction", [
        "class C:\n    import labkit.labs.threed as T",
        "def bubble_fraction(K, M):\n    return C.T._bubble_formula((K, M))"], "in the body of class C"),
    "sys imported in a class body, builtins' eval through it": ("1.1", "bubble_fraction", [
        "class C:\n    import sys as s",
        "def bubble_fraction(K, M):\n    return C.s.modules['builtins'].eval('K / M', {'K': K, 'M': M})"],
        "in the body of class C"),
    "an imported class aliased in a class body, its private name read": ("5.1", "segment_boundaries", [
        "from labkit.pipeline import ScheduleGPipe\nclass C:\n    S = ScheduleGPipe",
        "def segment_boundaries(n, k):\n    return C.S._builder(n, k)"], "`C.S._builder`"),
    "torch.compile naming a compiler of the learner's": ("1.1", "bubble_fraction", [
        "import torch\ntorch.compile(lambda x: x + 1, options={'cpp.cxx': ('/tmp/cc.sh',)})"], "`torch.compile`"),
    "a script made executable": ("1.1", "bubble_fraction", [
        "import os\nopen('/tmp/cc.sh', 'w').write('#!/bin/sh')\nos.chmod('/tmp/cc.sh', 0o755)"], "`os.chmod`"),
    # an eighth (static) red team's
    "locals() at the top level reaches the builtins": ("1.1", "bubble_fraction", [
        "locals()['__builtins__'].exec('x = 1')"], "`locals`"),
    "a dead import of getattr lifts the getattr-as-a-value rule": ("1.1", "bubble_fraction", [
        "from labkit.grading import check\nif 0:\n    from math import getattr\nimport functools\n"
        "G = functools.reduce(getattr, ['__glo' + 'bals__'], check)"], "rebinding `getattr`"),
    "a loop target rebound to a kit module by a function's global import": ("1.1", "bubble_fraction", [
        "box = []\ndef put(v):\n    box.append(v)\ndef g():\n    global S\n    import labkit.pipeline as S\n"
        "for S in [0]:\n    g()\n    put(S.bubble_formula)",
        "def bubble_fraction(K, M):\n    return float(box[0](K, M))"], "`global S`"),
    "torch's collect_env runs a shell": ("1.1", "bubble_fraction", [
        "import torch\ntorch.utils.collect_env.run('id')"], "collect_env"),
    "an audit hook gets sys.path": ("1.1", "bubble_fraction", [
        "import sys\ndef h(ev, a):\n    pass\nsys.addaudithook(h)"], "`sys.addaudithook`"),
    "os.open with an executable mode": ("1.1", "bubble_fraction", [
        "import os\nfd = os.open('/tmp/x.sh', os.O_CREAT | os.O_WRONLY, 0o755)"], "`os.open`"),
    "a symlink to a shell": ("1.1", "bubble_fraction", ["import os\nos.symlink('/bin/sh', '/tmp/ffmpeg')"],
                             "`os.symlink`"),
    "help imports the module a string names": ("1.1", "bubble_fraction", ["help('antigravity')"], "`help`"),
    "torch.jit compiles a string": ("1.1", "bubble_fraction", [
        "import torch\ncu = torch.jit.CompilationUnit('def f(x: int) -> int:\\n    return x\\n')"],
        "CompilationUnit"),
    # the environment a library's child process runs with (latex for usetex, a compiler, python workers)
    "PATH changed through os.environ": ("1.1", "bubble_fraction", [
        "import os\nos.environ['PATH'] = '/tmp/mine:' + os.environ['PATH']"], "`os.environ`"),
    "os.environ.update": ("1.1", "bubble_fraction", ["import os\nos.environ.update(LD_PRELOAD='/tmp/x.so')"],
                          "`os.environ`"),
    "environ imported and aliased": ("1.1", "bubble_fraction", [
        "from os import environ as E\nenv = E\nenv['PYTHONPATH'] = '/tmp'"], "`E`"),
    "os.putenv": ("1.1", "bubble_fraction", ["import os\nos.putenv('PATH', '/tmp')"], "`os.putenv`"),
    # an annotation runs when its def does: one with a call in it is code, not a type
    "a non-provided class called inside an annotation": ("9.3", "moe_param_count", [
        "from labkit.plan.spec import ModelSpec\nB = []",
        "def moe_param_count(spec: B.append(ModelSpec) or int) -> int:\n    return B[0]"],
        "`ModelSpec` (labkit.plan.spec)"),
    # the allow-list: a labkit name the notebook does not give (none of these is a listed reference)
    "a labkit function notebook 01 does not import": ("1.1", "bubble_fraction", [
        "from labkit.pipeline.explorer import describe\ndef bubble_fraction(K, M):\n    return describe(K, M)"],
        "`describe` (labkit.pipeline.explorer)"),
    "an unlisted function read through a module": ("1.2", "smallest_microbatches", [
        "import labkit.plan.flops as F\ndef smallest_microbatches(K, target):\n    return F.mfu(K, target)"],
        "`mfu` (labkit.plan.flops)"),
    "a function the package re-exports under a submodule's name": ("9.3", "moe_param_count", [
        "from labkit.pipeline import simulate\ndef moe_param_count(spec):\n    return simulate(spec)"],
        "`simulate` (labkit.pipeline)"),
    "a function defined before the top-level def of the reference's name": ("9.2", "capacity_keep", [
        _SETUP09, "def capacity_keep(indices, num_experts, capacity_factor):\n"
        "    return compute_capacity(indices.shape[0], num_experts, indices.shape[1], capacity_factor, 0)",
        "def compute_capacity():\n    pass"], "`compute_capacity`"),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_each_attack_is_refused_with_its_cell_and_line(name):
    ex, answer, cells, what = ATTACKS[name]
    found = _v(ex, answer, *cells)
    assert found, f"{name}: no violation found"
    assert any(what in str(v) for v in found), [str(v) for v in found]
    v = next(v for v in found if what in str(v))
    assert v.cell.startswith("cell ") and v.line >= 1 and v.why


HONEST = [
    ("1.1", "bubble_fraction", ["from labkit.grading import check\nimport math, os, sys, inspect",
                                "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError(K)\n"
                                "    return (K - 1) / (M + K - 1)",
                                "check('1.1', bubble_fraction)"]),
    # attributes of the learner's own objects, of instances, and of autograd's ctx are theirs
    ("5.3", "MyCheckpoint", ["import torch\nfrom torch import nn",
                             "class MyCheckpoint(torch.autograd.Function):\n    @staticmethod\n"
                             "    def forward(ctx, run, x):\n        ctx.run = run\n        return run(x)",
                             "MyCheckpoint.note = 'mine'\nm = nn.Linear(2, 2)\nm.weight.grad = None\n"
                             "for sub in m.modules():\n    pass\nsetattr(m, 'tag', 1)"]),
    # a cell the kit ships in the learner notebook may import the reference (notebook 08's first cell)
    ("8.6", "axis_bytes", [next(c for c in _shipped("08") if "comm_per_rank" in c and "import" in c),
                           "def axis_bytes(t, p, d):\n    return t * 4"]),
    # send/recv in the point-to-point exercise
    ("0.2", "ring_all_reduce", ["import torch.distributed as dist",
                                "def ring_all_reduce(ctx, x):\n    dist.send(x, 1)\n    dist.recv(x, 0)\n    return x"]),  # noqa: E501
    # 13.1 with torch.autograd.grad under any of its names; the allow-list's modules
    ("13.1", "split_linear_backward", [
        "from __future__ import annotations\nimport math, fractions, json, os, tempfile\nimport numpy as np\n"
        "import matplotlib.pyplot as plt\nfrom dataclasses import replace\nimport torch\nimport torch.autograd as A\n"
        "from torch import autograd\nfrom labkit.pipeline import one_f_one_b_schedule\n"
        "from labkit.grading import check",
        "def split_linear_backward(layer, x, grad_out):\n    out = layer(x)\n"
        "    (gi,) = A.grad(out, x, grad_out, retain_graph=True)\n"
        "    gw, gb = autograd.grad(out, [layer.weight, layer.bias], grad_out)\n    return gi, gw, gb",
        "check('13.1', split_linear_backward)"]),
    # attributes assigned on what the code made: instances, parameters of a module, self, a tensor
    ("2.3", "accumulate_microbatches", [
        "import torch\nfrom torch import nn",
        "class Box:\n    def __init__(self):\n        self.items = []\n"
        "    def add(self, x):\n        self.items.append(x)",
        "def accumulate_microbatches(model, x, y, M):\n    for p in model.parameters():\n        p.grad = None\n"
        "    for name, q in model.named_parameters():\n        q.grad = None\n    b = Box()\n    b.note = 1\n"
        "    w = torch.randn(3, requires_grad=True)\n    w.grad = None\n    lin = nn.Linear(2, 2)\n    lin.tag = 'x'\n"
        "    return b",
        "def helper():\n    pass\nhelper.cache = {}\nprint(getattr(torch, 'float32'), hasattr(torch, 'cat'))"]),
    # a parameter or local that shares a module's name is not the module; attributes by written name; safe loads
    ("8.3", "model_state_bytes", ["from labkit import plan as P\nimport torch, numpy as np",
                                  "def model_state_bytes(P, t, p, d, zero, precision):\n    return [P][0] / t",
                                  "print([torch for torch in range(2)], getattr(torch, 'float32'), "
                                  "hasattr(np, 'load'))\n"
                                  "w = torch.load('w.pt', weights_only=True)\na = np.load('a.npy')\n"
                                  "for P in ({'t': 1},):\n    print(P['t'], [P])\n"
                                  "with open('w.pt', 'rb') as np:\n    print([np])"]),
    # the learner's own top-level def of a reference's name, after the shipped import and before any use, is theirs
    ("9.1", "top_k_gate", [_SETUP09, "def route(logits, k):\n    return torch.topk(logits, k)",
                           "def top_k_gate(logits, k, renormalize=False):\n    w, i = route(logits.softmax(-1), k)\n"
                           "    return w, i"]),
    # the allow-list: what notebook 08 imports, as a module's attribute or from where it was defined; the
    # collective notebook 06's text tells the learner to call
    ("8.3", "model_state_bytes", ["import labkit.plan as P\nfrom labkit.plan import preset\n"
                                  "from labkit.plan.planner import candidates",
                                  "def model_state_bytes(spec, t, p, d, zero, precision):\n"
                                  "    return len(P.spec.PRESETS) + len(P.PRESETS) * 0 + (preset is candidates)"]),
    ("6.3", "ReduceFromRegion", ["import torch\nfrom labkit import comm",
                                 "class ReduceFromRegion(torch.autograd.Function):\n    @staticmethod\n"
                                 "    def forward(ctx, x, group):\n"
                                 "        return comm.all_reduce(x.clone(), group=group)"]),
    # a fifth red team's false positives: a local that shares an imported module's or reference's name
    ("8.2", "rank_groups", ["from labkit import plan as P",
                            "def rank_groups(rank, t, p, d):\n    P = [k * d * t for k in range(p)]\n    P.sort()\n"
                            "    return {'pp': P}"]),
    ("8.5", "choose_layout", [next(c for c in _shipped("08") if "import plan" in c or "plan," in c),
                              "def choose_layout(n):\n    ok = [(1, 2)]\n    plan = min(ok)\n    t, p = plan\n"
                              "    return t, p"]),
    # a labkit type named only in a signature (the stub's docstring names it)
    ("9.3", "moe_param_count", ["from labkit.plan.spec import ModelSpec",
                                "def moe_param_count(spec: ModelSpec) -> int:\n    x: ModelSpec = spec\n    return 1"]),
    # the kit's setup cell with a line added, its import statements unchanged
    ("9.1", "top_k_gate", [_SETUP09 + "\nimport numpy as np",
                           "def top_k_gate(logits, k, renormalize=False):\n    return torch.topk(logits, k)"]),
    # the environment read
    ("1.2", "smallest_microbatches", ["import os\nhome = os.environ['HOME']\nx = os.environ.get('X', '1')\n"
                                      "y = 'Y' in os.environ\nfrom os import environ\nz = environ.get('Z')"]),
    # reading labkit's source is the point of 12.3
    ("12.3", "gate_lines", ["import inspect\nfrom labkit.moe.router import route",
                            "def gate_lines():\n    return {'a': (route, inspect.getsource(route).splitlines()[0])}"]),
]


@pytest.mark.parametrize("i", range(len(HONEST)))
def test_honest_code_keeps_the_rules(i):
    ex, answer, cells = HONEST[i]
    assert _v(ex, answer, *cells) == []


def test_a_learner_may_edit_every_cell_the_kit_ships():
    """The allow-list is what the learner notebook's own cells import, and a kit cell whose comments or
    numbers (a seed, a size) the learner changed is still the kit's: each of its cells so edited breaks
    no rule of any exercise of its notebook (a fifth red team: a changed seed zeroed 9.2)."""
    import ast

    from labkit.grading.assignments import grading_points as points_of
    from labkit.grading.policy import _is_install_cell

    def bump(src: str) -> str:  # every integer literal one more (a seed, a size), written back from the tree
        tree = ast.parse(src)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and type(node.value) is int:
                node.value += 1
        return ast.unparse(tree)

    def relabel(src: str) -> str:  # every string changed, but in a cell that looks attributes up by computed names
        tree = ast.parse(src)
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr" and len(n.args) >= 2
               and not isinstance(n.args[1], ast.Constant) for n in ast.walk(tree)):
            return src
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and type(node.value) is str and not (
                    node.value.startswith("Exercise") or node.value[:3] in {f"{i}." for i in range(18)}):
                node.value += " (mine)"
        return ast.unparse(tree)

    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for edit in ("comment", "literals", "labels"):
            cells = [src if _is_install_cell(src) else src + "\n# edited" if edit == "comment" else bump(src)
                     if edit == "literals" else relabel(src)
                     for src in _shipped(path.stem[:2])]  # an edited install cell is refused on purpose
            for ex in exercises_for_notebook(path.stem):
                k = points_of(list(enumerate(cells)), [ex.id])[ex.id]
                assert k is not None, (path.name, ex.id)
                found = [str(v) for v in _v(ex.id, ANSWERS[ex.id], *cells[:k + 1])]
                assert found == [], (path.name, edit, ex.id, found)


def test_reading_source_is_refused_in_other_exercises():
    found = _v("12.4", "deepseek_v3_gate", "import inspect\nfrom labkit.moe.router import route",
               "def deepseek_v3_gate():\n    return inspect.getsource(route)")
    assert any("getsource" in str(v) for v in found)


def test_every_solution_keeps_the_rules_and_names_its_answer():
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        cells = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        ids = [ex.id for ex in exercises_for_notebook(path.stem)]
        points = grading_points(cells, ids)
        for ex_id in ids:
            k = points[ex_id]
            assert k is not None, (path.name, ex_id)
            assert f"check(\"{ex_id}\", {ANSWERS[ex_id]})" in cells[k][1], (path.name, ex_id, ANSWERS[ex_id])
            found = check_cells(ex_id, ANSWERS[ex_id], [(f"cell {i + 1}", s) for i, s in cells[:k + 1]])
            assert found == [], (path.name, ex_id, [str(v) for v in found])
    shipped = {ex.id for ex in all_exercises() if ex.notebook in {p.stem for p in (ROOT / "solutions").glob("*.ipynb")}}
    assert set(ANSWERS) == shipped  # other tests register their own exercises (T.1, H.1) in this process


# ----------------------------------------------------------------------------- the grader end to end


def _grade(tmp_path, cells, assignment, name="submission.ipynb", metadata=None):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    if metadata:
        nb.metadata["labkit"] = {"notebook": metadata}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in cells]
    path = tmp_path / name
    nbformat.write(nb, str(path))
    results = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "labkit", "grade", str(path), "--results", str(results), "--cell-timeout", "60"]
    if assignment:
        cmd += ["--assignment", assignment]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(results.read_text())


def _solution_cells(stem: str) -> list[str]:
    nb = nbformat.read(str(ROOT / "solutions" / f"{stem}.ipynb"), as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_assignment_is_pinned_whatever_the_submission_holds(tmp_path):
    sol01 = _solution_cells("01_pipeline_bubble")
    # solved 01 with its check() cells deleted: still graded from the functions it defines, 4 of 4
    no_checks = [s for s in sol01 if "check(" not in s or "def " in s]
    no_checks = [s.replace('check("1.1", bubble_fraction)', "").replace('check("1.2", smallest_microbatches)', "")
                 for s in no_checks]
    assert not any('check("1.' in s for s in no_checks)
    proc, obj = _grade(tmp_path, no_checks, "01_pipeline_bubble")
    assert obj["score"] == 4, obj["output"]
    # solved 01 uploaded for assignment 02 (its metadata still says 01, as build wrote it): graded on
    # 02's exercises, whatever the metadata says; it defines none of them
    proc, obj = _grade(tmp_path, sol01, "02_gpipe", name="02_gpipe.ipynb", metadata="01_pipeline_bubble")
    assert obj["score"] == 0
    assert {t["name"].split(" (")[0] for t in obj["tests"] if t["max_score"]} == {"Exercise 2.1", "Exercise 2.2",
                                                                                   "Exercise 2.3"}
    assert "does not hold assignment 02_gpipe" in obj["output"], obj["output"]
    assert "it looks like 01_pipeline_bubble" in obj["output"]
    # solved 02 uploaded for assignment 01: a cell of 02 imports 1.1's name (bubble_fraction, for its
    # plots), so 1.1 is judged and zeroed by the policy; the output says which notebook it looks like
    proc, obj = _grade(tmp_path, _solution_cells("02_gpipe"), "01_pipeline_bubble", name="hw.ipynb",
                       metadata="02_gpipe")
    assert obj["score"] == 0
    assert "the submission looks like 02_gpipe, not assignment 01_pipeline_bubble" in obj["output"], obj["output"]


def test_grade_refuses_an_unknown_assignment(tmp_path):
    nb = nbformat.v4.new_notebook()
    nbformat.write(nb, str(tmp_path / "s.ipynb"))
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(tmp_path / "s.ipynb"), "--assignment",
                           "99_nothing"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: --assignment 99_nothing") and "01_pipeline_bubble" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_interactive_check_shows_the_same_rule(capsys):
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    shell = InteractiveShell.instance(config=config)
    try:
        for src in ["from labkit.grading import check\nfrom labkit.pipeline.simulate import bubble_formula",
                    "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError(K)\n"
                    "    return bubble_formula(K, M)",
                    "r = check('1.1', bubble_fraction)"]:
            shell.run_cell(src, store_history=True)
        out = capsys.readouterr().out
        assert "failed: the grader gives 0 points for this code: In [1], line 2: import of `bubble_formula`" in out, out
        assert "(and 1 more)" in out, out     # In [2]'s use of it
        assert shell.user_ns["r"].status == "failed"
        # principle 3: the reference imported in any cell before the check counts; a fresh kernel without it passes
        InteractiveShell.clear_instance()
        shell = InteractiveShell.instance(config=config)
        for src in ["from labkit.grading import check",
                    "def bubble_fraction(K, M):\n    if K < 1 or M < 1:\n        raise ValueError(K)\n"
                    "    return (K - 1) / (M + K - 1)",
                    "r = check('1.1', bubble_fraction)"]:
            shell.run_cell(src, store_history=True)
        out = capsys.readouterr().out
        assert "passed" in out and shell.user_ns["r"].status == "passed", out
    finally:
        InteractiveShell.clear_instance()


# ----------------------------------------------------------------------------- fresh inputs


def _smallest(K, target):
    M = 1
    while (K - 1) / (M + K - 1) > target:
        M += 1
    return M


FIXED_12 = [(4, 0.10), (8, 0.25), (1, 0.01), (3, 0.3), (4, 0.05), (5, 0.15)] + [
    (K, t) for K in (2, 3, 6, 16) for t in (0.5, 0.3, 0.07, 0.013)]


def test_a_lookup_table_of_the_shipped_inputs_fails_the_fresh_case():
    from labkit.grading.runner import evaluate

    table = {k: _smallest(*k) for k in FIXED_12}

    def smallest_microbatches(K, target):
        return table.get((K, target), 1)

    res = evaluate("1.2", smallest_microbatches)
    by_name = {c.name: c.status for c in res.cases}
    fixed = {n: s for n, s in by_name.items() if "fresh" not in n}
    assert set(fixed.values()) == {"passed"}, fixed  # every shipped case is fooled ...
    assert by_name["grid of K and targets; random K and targets (fresh inputs)"] == "failed"  # ... fresh is not
    assert res.status == "failed"

    table3 = {(K, M): [min(M, K - s) for s in range(K)] for K, M in [(4, 8), (4, 2), (1, 5), (6, 4), (8, 64)]}
    res = evaluate("3.2", lambda K, M: table3.get((K, M), [0] * K))
    assert [c.status for c in res.cases if "fresh" in c.name] == ["failed"]


def test_fresh_inputs_differ_between_runs(tmp_path):
    from labkit.grading.registry import get_exercise
    from labkit.grading.runner import run_case

    log = tmp_path / "inputs.txt"

    def bubble_fraction(K, M):  # runs in the case's forked process: record what it was asked
        with open(log, "a") as f:
            f.write(f"{K},{M}\n")
        return (K - 1) / (M + K - 1)

    ex = get_exercise("1.1")
    case = next(c for c in ex.cases if "fresh" in c.name)
    assert case.hidden
    runs = []
    for _ in range(2):
        log.write_text("")
        assert run_case(case, bubble_fraction, ex).status == "passed"
        runs.append(log.read_text())
    assert runs[0] and runs[1] and runs[0] != runs[1]


def test_every_named_exercise_has_a_fresh_hidden_case():
    from labkit.grading.registry import get_exercise

    for ex_id in ("0.1", "1.1", "1.2", "2.1", "3.1", "3.2", "4.1", "4.2", "4.3", "7.1", "8.1", "8.2", "8.3", "8.4",
                  "8.6", "11.1", "12.1", "13.2"):
        assert any("fresh" in c.name and c.hidden for c in get_exercise(ex_id).cases), ex_id


# ----------------------------------------------------------------------------- instructor's secret cases

SECRET = 7919
SECRET_CASES = f'''
from labkit.grading.registry import exercise, expect_equal

ex = exercise("S.1", title="echo", notebook="97_secret", points=1)
@ex.case("x=2", hidden=False)
def _(f): expect_equal(f(2), 2, "f(2)")
@ex.case("secret input")
def _(f): expect_equal(f({SECRET}), {SECRET}, "f(secret)")

ex = exercise("S.2", title="recall", notebook="97_secret", points=1)
@ex.case("x=3", hidden=False)
def _(f): expect_equal(f(3), 3, "f(3)")
'''


def test_secret_inputs_never_reach_a_visible_result(tmp_path):
    # the answer remembers every input it was given (in the kernel and on disk) and returns the
    # oldest one it remembers: if the secret case ran first, or in the same kernel, the public
    # case would fail with "got <secret>"
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "secret.py").write_text(SECRET_CASES)
    import os

    # the notebook's own folder: every kernel of the submission sees it (a private /tmp does not hide it)
    os.chmod(tmp_path, 0o777)  # writable by the kernels' uids too
    memory = tmp_path / "seen.txt"
    cells = ["from labkit.grading import check",
             f"def echo(x):\n    try:\n        with open({str(memory)!r}, 'a') as f:\n            f.write(f'{{x}}\\n')\n"  # noqa: E501
             f"        return int(open({str(memory)!r}).read().split()[0])\n    except OSError:\n        return x",
             "check('S.1', echo)",
             f"def recall(x):  # the largest input ever seen: the secret, if it reached this kernel first\n"
             f"    try:\n        with open({str(memory)!r}, 'a') as f:\n            f.write(f'{{x}}\\n')\n"
             f"        return max(int(v) for v in open({str(memory)!r}).read().split())\n"
             f"    except OSError:\n        return x",
             "check('S.2', recall)"]
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(s) for s in cells]
    nbformat.write(nb, str(tmp_path / "s.ipynb"))
    results = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "labkit", "grade", str(tmp_path / "s.ipynb"), "--assignment",
                           "97_secret", "--results", str(results)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300, env=dict(__import__("os").environ, LABKIT_HIDDEN_CASES=str(tmp_path / "cases")))
    assert proc.returncode == 0, proc.stderr
    obj = json.loads(results.read_text())
    by_name = {t["name"]: t for t in obj["tests"]}
    assert by_name["Exercise S.1 (echo) - case: x=2"]["status"] == "passed"  # graded before any secret input
    shared = memory.exists()  # as root each kernel is jailed (its own uid, a private /tmp): nothing is shared
    if shared:
        assert by_name["Exercise S.1 (echo) - hidden case: secret input"]["status"] == "failed"  # it got 2 back
    assert by_name["Exercise S.2 (recall) - case: x=3"]["status"] == "passed", by_name  # no secret seen yet
    assert str(SECRET) not in json.dumps({k: v for k, v in obj.items()}) + proc.stdout
    if shared:
        assert memory.read_text().split()[:3] == ["2", "3", str(SECRET)]  # every public input came first


def test_visible_messages_show_type_and_size_of_learner_text_not_the_text():
    import torch

    from labkit.grading.registry import CheckFailure, expect_close, expect_equal

    secret = "the instructor's input 7919"
    for got, expected, shown in [(secret, "abc", "a str of length 27"), ([secret], [1], "got a str of length 27"),
                                 ({secret: 1}, {"a": 1}, "got 1 keys; missing ['a']; 1 other(s)"),
                                 (secret, torch.ones(2), "a str of length 27"), (secret, 1.0, "a str of length 27"),
                                 (secret, [1], "a str of length 27"), ([secret] * 9, (1,), "expected 1 items, got 9"),
                                 ({"a": secret}, {"a": 1}, "got a str of length 27")]:
        for expect in (expect_equal, expect_close):
            try:
                expect(got, expected, "f(x)")
            except CheckFailure as e:
                assert "7919" not in str(e) and shown in str(e), (expect.__name__, str(e))
            else:
                raise AssertionError("no failure")
    # numbers and small numeric values are still shown: they are what a learner needs to see
    try:
        expect_equal([1, 2, 4], [1, 2, 3], "f(x)")
    except CheckFailure as e:
        assert "expected 3, got 4" in str(e)


def test_the_install_cell_build_writes_is_allowed_and_an_edited_one_is_not():
    from labkit.grading.build import INSTALL_CELL

    answer = ("cell 2", "def bubble_fraction(K, M):\n    return (K - 1) / (M + K - 1)")
    assert check_cells("1.1", "bubble_fraction", [("cell 1", INSTALL_CELL), answer]) == []
    edited = INSTALL_CELL + "\nimport subprocess"
    found = check_cells("1.1", "bubble_fraction", [("cell 1", edited), answer])
    assert {v.what for v in found} >= {"import of `subprocess`", "`get_ipython`"}, found


def test_every_listed_reference_is_a_real_object():
    """A misspelt entry would protect nothing: each ``module:qualname`` imports and resolves."""
    import importlib

    from labkit.grading.references import REFERENCES

    labels = {lab for labs in REFERENCES.values() for lab in labs}
    labels |= {lab for ex in all_exercises() for lab in ex.reference_names()}
    for label in sorted(labels):
        mod, _, qual = label.partition(":")
        obj = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)



@pytest.mark.parametrize("warm", [True, False], ids=["kernel-warm-up", "without-it"])
def test_a_backend_named_in_rcparams_after_the_warm_up_is_never_imported(warm, tmp_path):
    """The graded kernel's warm-up resolves pyplot's backend: a "module://name" put in rcParams later
    (a computed string the policy cannot read) imports nothing when a figure is made. Without the
    warm-up (the control) matplotlib imports the named module."""
    from labkit.grading.session import PLOTS_WARM_UP, WARM_UP

    code = (WARM_UP + PLOTS_WARM_UP if warm else "import sys") + (
        "\nimport matplotlib, matplotlib.pyplot as plt\nassert 'wave' not in sys.modules\n"
        "matplotlib.rcParams['backend'] = 'mod' + 'ule://wave'\n"
        "try:\n    plt.figure()\nexcept Exception:\n    pass\n"
        "print('imported' if 'wave' in sys.modules else 'not imported')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, MPLBACKEND="Agg", MPLCONFIGDIR=str(tmp_path)))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-2:] == (["not", "imported"] if warm else ["imported"]), run.stdout
