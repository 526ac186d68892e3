"""What an ``exclude`` entry matches: one rule, read by both quantizers (ONNX Q/DQ placement and ModelOpt).

An entry is either
- a **PyTorch module name** (``blocks.3.attn``, ``layer1.0``: identifiers joined by dots, at least one dot): every node
  the module and its children produced, found through the exporter's scope names (:func:`module_of_node`), so
  ``blocks.1`` never catches ``blocks.10``; or
- a **regular expression** searched in the ONNX node names (``/layer1/.*/Conv``, or a bare name like ``conv1``,
  which matches wherever it appears), as before.
"""
from __future__ import annotations

import re
from typing import Callable

from qdeploy.errors import ConfigError

WRAPPER_SCOPE = "model"  # models.loader.SelectOutput's attribute: the first scope of every exported node
_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.\w+)+$")


def module_of_node(node_name: str) -> str:
    """``/model/layer1/layer1.0/conv1/Conv`` → ``layer1.0.conv1`` (scopes are nested module names)."""
    scopes = [s for s in node_name.strip("/").split("/")[:-1] if s]
    if scopes and scopes[0] == WRAPPER_SCOPE:
        scopes = scopes[1:]
    # a scope that extends the previous one ("features" → "features.1") indexes into it (Sequential children);
    # any other scope is an attribute of the module so far ("block" under "features.1.0")
    path, prev = "", ""
    for scope in scopes:
        if prev and scope.startswith(prev + "."):
            path += scope[len(prev):]
        else:
            path = f"{path}.{scope}" if path else scope
        prev = scope
    return path


def scope_key(module: str) -> str:
    """A module name as comparable with :func:`module_of_node` of an exported node: an onnx2torch twin's modules are
    named after ONNX nodes, '/' included (``efficientnetb0_1/block7a_dwconv_1/depthwise``), and export scopes split
    on '/', so both sides read '/' as '.'."""
    return module.replace("/", ".")


def is_module_name(pattern: str) -> bool:
    return bool(_MODULE_PATH.match(pattern))


def matcher(pattern: str) -> Callable[[str], bool]:
    """node name → does ``pattern`` (a module name or a regex, see the module docstring) match it."""
    if is_module_name(pattern):
        return lambda name: (m := module_of_node(name)) == pattern or m.startswith(pattern + ".")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"exclude pattern '{pattern}' is neither a PyTorch module name (blocks.3.attn) nor a valid "
                          f"regular expression on ONNX node names: {e}") from None
    return lambda name: rx.search(name) is not None


def match_nodes(names: list[str], patterns: list[str]) -> tuple[list[str], dict[str, int]]:
    """(the node names any pattern matches, in order; {pattern: how many nodes it matched})."""
    compiled = [(p, matcher(p)) for p in patterns]
    hits = {p: 0 for p in patterns}
    matched = []
    for name in names:
        which = [p for p, m in compiled if m(name)]
        for p in which:
            hits[p] += 1
        if which:
            matched.append(name)
    return matched, hits
