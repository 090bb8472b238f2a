#!/usr/bin/python3
"""Writes optimizer_torch_vectors.txt: PyTorch's SGD, Adam and AdamW on fixed float32 tensors.

Run once, by hand, from the repository root, after
`apt-get install -y --no-install-recommends python3-torch` (Debian 12: torch 1.13):
    /usr/bin/python3 common/testdata/make_optimizer_vectors.py \
        > common/testdata/optimizer_torch_vectors.txt
The C++ test (common/optimizer_test.cc) reads the file; it never runs this script or needs torch.
"""

import sys

import torch

ELEMENTS = 12
STEPS = 10

# name, torch optimizer, kwargs, and the same settings as OptimizerConfig fields.
CONFIGS = [
    ("sgd", torch.optim.SGD, dict(lr=0.1),
     dict(type="sgd", lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=0)),
    ("sgd_momentum", torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-4),
     dict(type="sgd", lr=0.1, weight_decay=1e-4, momentum=0.9, nesterov=0)),
    ("sgd_nesterov", torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True),
     dict(type="sgd", lr=0.1, weight_decay=0.0, momentum=0.9, nesterov=1)),
    ("adam", torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8),
     dict(type="adam", lr=1e-3, weight_decay=0.01, momentum=0.0, nesterov=0)),
    ("adamw", torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8),
     dict(type="adamw", lr=1e-3, weight_decay=0.01, momentum=0.0, nesterov=0)),
]


def fmt(t):
    # %.9g round-trips every float32 exactly.
    return " ".join("%.9g" % x for x in t.tolist())


def main():
    out = sys.stdout
    out.write(
        "# PyTorch %s optimizer trajectories, written by make_optimizer_vectors.py; do not edit.\n"
        "# Format, one record per line, fields separated by single spaces:\n"
        "#   config NAME type=T lr=X weight_decay=X momentum=X nesterov=0|1\n"
        "#   init W1 ... Wn          weights before the first step (float32, %%.9g)\n"
        "#   grad S G1 ... Gn        gradient of step S (1-based)\n"
        "#   after S W1 ... Wn       weights after step S\n"
        "#   end\n"
        "# Adam/AdamW use betas (0.9, 0.999) and eps 1e-8. Lines starting with # are comments.\n"
        % torch.__version__)
    for index, (name, cls, kwargs, fields) in enumerate(CONFIGS):
        gen = torch.Generator().manual_seed(1000 + index)
        w = torch.randn(ELEMENTS, generator=gen, dtype=torch.float32)
        w[0] = 0.0  # a zero weight
        param = torch.nn.Parameter(w.clone())
        opt = cls([param], foreach=False, **kwargs)
        out.write("config %s %s\n" % (name, " ".join("%s=%s" % kv for kv in fields.items())))
        out.write("init %s\n" % fmt(param.detach()))
        for step in range(1, STEPS + 1):
            g = torch.randn(ELEMENTS, generator=gen, dtype=torch.float32) * (0.5 ** (step % 3))
            g[1] = 0.0  # an element that never sees a gradient (Adam: 0 / (0 + eps))
            if step % 4 == 0:
                g[2] = 0.0  # and one that sometimes does not
            param.grad = g.clone()
            opt.step()
            out.write("grad %d %s\n" % (step, fmt(g)))
            out.write("after %d %s\n" % (step, fmt(param.detach())))
        out.write("end\n")


if __name__ == "__main__":
    main()
