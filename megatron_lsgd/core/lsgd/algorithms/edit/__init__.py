"""EDiT and A-EDiT (Cheng et al., "EDiT: A Local-SGD-Based Efficient Distributed Training
Method for Large Language Models"; DESIGN.md §4.4): layer-wise parameter sync in the forward
pass with prefetch and a pseudo-gradient penalty, every H steps (`edit.py`) or every
wall-clock interval (`a_edit.py`); the penalty's arithmetic is in `penalty.py`."""
