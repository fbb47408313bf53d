"""The Trainer stays narrow (issue 51): the training loops work on the run's Position and
the collaborators named in their constructors, never on the Trainer itself."""

from __future__ import annotations

import ast
import inspect

import megatron_lsgd.training.lockstep_loop as lockstep_loop
import megatron_lsgd.training.meeting_loop as meeting_loop

LOOPS = (lockstep_loop, meeting_loop)


def _names(module) -> set:
    """Every identifier and attribute name the module's code uses."""
    tree = ast.parse(inspect.getsource(module))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def test_the_loops_never_reach_the_trainer():
    for module in LOOPS:
        used = _names(module)
        assert not used & {"trainer", "tr"}, f"{module.__name__} reaches the Trainer"
