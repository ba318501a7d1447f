"""`miles tasks ...`: Harbor-format task utilities."""

from __future__ import annotations

import argparse
import asyncio
import sys


def _dirs(paths: list[str]):
    """The task directories of `paths`, or None after printing why there are none."""
    from miles.agentic.harbor.task import TaskError, task_dirs

    try:
        return task_dirs(paths)
    except TaskError as e:
        print(f"miles: error: {e}", file=sys.stderr)
        return None


def _cmd_check(args: argparse.Namespace) -> int:
    from miles.agentic.harbor.check import TaskCheck, check_tasks, report
    from miles.agentic.harbor.task import TaskError, load_task

    if (dirs := _dirs(args.paths)) is None:
        return 2
    tasks, refused = [], []  # a task that cannot be read is a row of its own, not the end of the check
    for d in dirs:
        try:
            tasks.append(load_task(d))
        except TaskError as e:
            refused.append(TaskCheck(d.name, None, None, str(e)))
    from miles.agentic.sandbox.container import ContainerSandboxConfig

    if args.image_dir and args.runtime == "local":
        print(
            "miles: error: --image-dir needs a container runtime (--runtime apptainer or enroot)",
            file=sys.stderr,
        )
        return 2
    backend = (
        None
        if args.runtime == "local"
        else ContainerSandboxConfig(runtime=args.runtime, image_dir=args.image_dir)
    )
    run = check_tasks(tasks, jobs=args.jobs, backend=backend, internet=args.internet)
    checked = asyncio.run(run) if tasks else []
    table, ok = report(sorted([*checked, *refused], key=lambda r: r.task))
    print(table)
    return 0 if ok else 1


def _cmd_build(args: argparse.Namespace) -> int:
    from miles.agentic.harbor.build import build_task
    from miles.agentic.harbor.task import TaskError, load_task

    if (dirs := _dirs(args.paths)) is None:
        return 2
    failed = 0
    for d in dirs:  # every task a row: one that cannot be read or built does not stop the others
        try:
            path, how = build_task(load_task(d), args.image_dir, runtime=args.runtime)
            print(f"{d.name}: {how} {path}")
        except TaskError as e:
            failed += 1
            print(f"{d.name}: error: {e}")
    return 1 if failed else 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from miles.agentic.harbor.convert import convert_paths

    rows = convert_paths(args.paths, args.out)
    for src, result in rows:
        print(f"{src} -> {result}" if not result.startswith("error:") else f"{src}: {result}")
    return 0 if rows and not any(r.startswith("error:") for _, r in rows) else 1


def _cmd_generate(args: argparse.Namespace) -> int:
    from miles.agentic.harbor.generate import generate

    for path in generate(args.out, args.n, args.seed, args.start):
        print(path)
    return 0


def add_tasks_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tasks", help="Harbor-format tasks: check a dataset, generate small tasks")
    tsub = p.add_subparsers(dest="tasks_cmd", required=True)
    q = tsub.add_parser(
        "check",
        help="run each task's solution and a do-nothing agent through the episode path; exit 1 unless "
        "every oracle scores 1 and every do-nothing agent 0",
    )
    q.add_argument("paths", nargs="+", help="task directories or folders of tasks")
    q.add_argument("--jobs", type=int, default=2, help="tasks checked at once")
    q.add_argument(
        "--runtime",
        choices=("local", "apptainer", "enroot"),
        default="local",
        help="local: bubblewrap with this host's toolchain; apptainer / enroot: each task's own image",
    )
    q.add_argument(
        "--image-dir",
        help="run the tasks' images from files pulled ahead into this directory (NAME_TAG.sif for "
        "apptainer, NAME+TAG.sqsh for enroot) instead of the registry",
    )
    q.add_argument(
        "--internet",
        choices=("auto", "off"),
        default=None,
        help="auto: tasks that set allow_internet (Harbor's default) get egress where this node has it "
        "(local runtime: a network namespace of pasta's); off: no episode gets network (default: "
        "$MILES_TASKS_INTERNET, else auto)",
    )
    q.set_defaults(func=_cmd_check)
    q = tsub.add_parser(
        "build",
        help="build each task's image from its Dockerfile (network at build time) into --image-dir, "
        "which `--runtime R --image-dir` episodes then start from; a task naming docker_image is pulled",
    )
    q.add_argument("paths", nargs="+", help="task directories or folders of tasks")
    q.add_argument(
        "--runtime",
        choices=("apptainer", "enroot"),
        default="apptainer",
        help="the images' format: apptainer (SIF) or enroot (squashfs)",
    )
    q.add_argument(
        "--image-dir", required=True, help="where the images go (and the base images are, pulled ahead)"
    )
    q.set_defaults(func=_cmd_build)
    q = tsub.add_parser(
        "convert", help="rewrite Terminal-Bench 1 tasks (task.yaml, run-tests.sh) in Harbor's format"
    )
    q.add_argument("paths", nargs="+", help="Terminal-Bench 1 task directories or folders of them")
    q.add_argument("--out", required=True, help="folder the converted tasks are written to")
    q.set_defaults(func=_cmd_convert)
    q = tsub.add_parser("generate", help="write procedural tasks small enough for a tiny model")
    q.add_argument("out", help="dataset folder to write")
    q.add_argument("--n", type=int, default=16)
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--start", type=int, default=0, help="first task index")
    q.set_defaults(func=_cmd_generate)
