"""On import, ask Linux to end this process (SIGTERM) when its parent dies: named in the
preload of a fork server that multiprocessing starts as a fresh interpreter
(`lifecycle.spawn_fork_server`, where `lifecycle.start_fork_server` cannot fork one), in which
nothing else of ours runs before its loop. Without it, a supervisor killed by SIGKILL or the
OOM killer left that server running, and with it every stage (each child watches the server,
and holds its alive pipe). A parent that died before this took hold closed the server's alive
pipe, its only holder then: the server ends on that."""

from omni_pipeline.lifecycle import die_with_parent

die_with_parent()
