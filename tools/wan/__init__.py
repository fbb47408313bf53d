"""WAN emulation: S sites as Linux network namespaces joined by shaped links.

    link.py       LinkSpec (rate, one-way delay, jitter, loss) and its tc commands
    netns.py      running `ip`/`tc` with errors that say what failed
    preflight.py  root? ip? tc? namespaces allowed? which qdiscs does the kernel have?
    wire.py       userspace link over TUN devices, for kernels without sch_netem
    topology.py   WanTopology: build the sites, always tear them down
    launch.py     one torchrun per site inside its namespace; CLI

Everything lives in one private /24 (default 10.77.0.0/24) that exists only inside the
namespaces created here; no route leads out of them.
"""
