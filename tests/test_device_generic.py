"""Static check: no tensor factory in hetcomm/moe or hetcomm/backends runs without a device.

Code there must run on CUDA and Ascend tensors as well as on CPU (issue 10, item 6). A factory
called without ``device=`` makes a CPU tensor, and the first index into it with a device
tensor fails (or, worse, silently copies through host memory). The check reads the source
(AST), so it covers code paths no CPU test executes.

Factories checked (:data:`FACTORIES`): ``torch.empty``, ``zeros``, ``ones``, ``full``,
``arange``, ``tensor``, ``as_tensor``, ``rand``, ``randn``, ``randint``, ``randperm``, ``eye``,
``linspace``, ``logspace``, ``empty_strided``. Not checked: ``torch.*_like`` and
``tensor.new_*`` (they follow their input's device by default), and ``torch.cat``/``stack``
(they follow their inputs).

A call passes when it has a ``device=`` keyword (or ``**kwargs``), or when its line (or the
line before) carries a comment ``# host:`` saying why a host tensor is right there (a pinned
staging buffer, a tensor only ever used for host bookkeeping, ...).
"""

from __future__ import annotations

import ast
import os
from typing import List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = [os.path.join(REPO, "hetcomm", "moe"), os.path.join(REPO, "hetcomm", "backends")]
FACTORIES = {
    "empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "rand", "randn",
    "randint", "randperm", "eye", "linspace", "logspace", "empty_strided",
}
MARKER = "# host:"


def violations(path: str) -> List[str]:
    """``file:line: torch.X(...) without device=`` for every unmarked factory call in ``path``."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source, filename=path)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if not (isinstance(fn, ast.Attribute) and fn.attr in FACTORIES
                and isinstance(fn.value, ast.Name) and fn.value.id == "torch"):
            continue
        if any(k.arg in ("device", None) for k in node.keywords):  # None: **kwargs
            continue
        near = lines[node.lineno - 1 : getattr(node, "end_lineno", node.lineno)]
        if node.lineno >= 2:
            near.append(lines[node.lineno - 2])
        if any(MARKER in line for line in near):
            continue
        out.append(f"{os.path.relpath(path, REPO)}:{node.lineno}: torch.{fn.attr}(...) without device=")
    return out


def _python_files():
    for root in ROOTS:
        for dirpath, _, files in os.walk(root):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def test_every_tensor_factory_names_its_device():
    bad = [v for path in _python_files() for v in violations(path)]
    assert not bad, (
        "tensor factories without device= (pass device=<the input's device>, or mark a deliberate "
        "host tensor with a '# host: why' comment):\n" + "\n".join(bad)
    )


def test_the_check_catches_a_bare_factory(tmp_path):
    p = tmp_path / "m.py"
    p.write_text(
        "import torch\n"
        "a = torch.zeros(3)\n"                      # flagged
        "b = torch.zeros(3, device=x.device)\n"     # fine
        "c = torch.arange(4)  # host: loop bounds\n"  # marked
        "d = torch.zeros_like(b)\n"                 # follows b
        "e = torch.full((2,), 1, **kw)\n"           # device may be in kw
    )
    assert [v.rsplit(":", 2)[-2] for v in violations(str(p))] == ["2"]
