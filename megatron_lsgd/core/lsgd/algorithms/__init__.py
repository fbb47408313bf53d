"""The built-in synchronizers, one module or package each; `catalog.py` discovers them
(every module here is imported, and each registers its classes with `@register`). The kit
they share (comm, means, compressors, fragments, outer state, the site split, the warm-up,
...) lives one level up, in `core/lsgd/`."""
