#!/usr/bin/env python3
"""Generated request traces of other shapes than the Mooncake conversation trace, in its format
(JSON lines of timestamp, input_length, output_length, hash_ids: one id per 512 tokens, equal
ids for equal prefixes), for checking that an eviction policy generalizes (issue 34):

  short-sessions   many concurrent sessions of 2 to 4 turns over 10 shared system prompts
  hot-prompt       one hot 8-block system prompt, then a suffix nobody reads again
  long-documents   documents of 50 to 200 blocks read once, among 50 recurring conversations

    python3 bench/python/trace_shapes.py --shape short-sessions --requests 12000 --seed 1 > t.jsonl
    sparsekv replay --trace t.jsonl --capacity-blocks 500 --sim-policy arc
"""

import argparse
import json
import random
import sys

BLOCK = 512


def short_sessions(rng, n, new):
    prompts = [[new() for _ in range(2)] for _ in range(10)]
    active, out = [], []
    while len(out) < n:
        if len(active) < 400 or rng.random() < 0.05:
            active.append({"ids": list(rng.choice(prompts)), "turns": rng.randint(2, 4)})
        s = rng.choice(active)
        s["ids"] += [new() for _ in range(rng.randint(1, 3))]
        out.append(list(s["ids"]))
        s["turns"] -= 1
        if s["turns"] == 0:
            active.remove(s)
    return out


def hot_prompt(rng, n, new):
    hot = [new() for _ in range(8)]
    return [hot + [new() for _ in range(rng.randint(1, 10))] for _ in range(n)]


def long_documents(rng, n, new):
    convs = [[new() for _ in range(3)] for _ in range(50)]
    out = []
    for _ in range(n):
        if rng.random() < 0.3:
            out.append([new() for _ in range(rng.randint(50, 200))])
        else:
            c = rng.choice(convs)
            c.append(new())
            if len(c) > 40:
                del c[3:]
            out.append(list(c))
    return out


SHAPES = {"short-sessions": short_sessions, "hot-prompt": hot_prompt, "long-documents": long_documents}


def generate(shape, requests, seed):
    rng = random.Random(seed)
    counter = [0]

    def new():
        counter[0] += 1
        return counter[0]

    lines = []
    for i, ids in enumerate(SHAPES[shape](rng, requests, new)):
        length = (len(ids) - 1) * BLOCK + rng.randint(1, BLOCK)  # the last block partial
        lines.append({"timestamp": i * 100, "input_length": length, "output_length": 64, "hash_ids": ids})
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    for line in generate(a.shape, a.requests, a.seed):
        sys.stdout.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
