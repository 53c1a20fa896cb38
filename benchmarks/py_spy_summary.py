"""Where a Python process's threads spend their time, from py-spy's collapsed stacks
(`py-spy record --format raw --threads`, as `serve_load.py --profile-server` writes): samples per
thread, then per thread the functions with the most samples including their callees, and the
innermost frames (where the time is actually spent).

    python benchmarks/py_spy_summary.py OUT/serve_py_spy.txt --top 25
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

# "thread (123): name;frame (file:line);frame (file:line) 42"
LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")
FRAME_LINE = re.compile(r":\d+\)$")


def function(frame: str) -> str:
    """A frame without its line number: "Engine._step (lmforge/serve/engine.py)"."""
    return FRAME_LINE.sub(")", frame)


def summarize(path: Path, top: int) -> str:
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    innermost: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    per_thread: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        match = LINE.match(line)
        if not match:
            continue
        thread, *frames = match["stack"].split(";")
        process = ""
        while thread.startswith("process ") and frames:  # --subprocesses: parents first
            process, thread = thread, frames.pop(0)
        thread = re.sub(r"\(\d+\)", "", thread).strip()  # the name, without the native id
        if process:  # "process 12:"python -m lmforge serve ..."" -> "lmforge serve"
            module = re.search(r" -m (\S+(?: serve)?)", process)
            thread = f"{module[1] if module else process.split()[1]}: {thread}"
        count = int(match["count"])
        per_thread[thread] += count
        for name in {function(f) for f in frames}:
            inclusive[thread][name] += count
        if frames:
            innermost[thread][function(frames[-1])] += count
    total = sum(per_thread.values())
    lines = [f"{path.name}: {total} samples"]
    for thread, samples in per_thread.most_common():
        lines.append(f"\n{thread}: {samples} samples ({100 * samples / total:.1f}%)")
        lines.append("  including callees:")
        for name, count in inclusive[thread].most_common(top):
            lines.append(f"    {100 * count / samples:5.1f}%  {name}")
        lines.append("  innermost frame:")
        for name, count in innermost[thread].most_common(top // 2):
            lines.append(f"    {100 * count / samples:5.1f}%  {name}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(summarize(args.profile, args.top))


if __name__ == "__main__":
    main()
