"""The Rubato launcher (`rubato launch`, deploy/launch.py): runs a job's rubato_server and
rubato_worker processes on 127.0.0.1 or across the hosts of a host file, shows their progress and
writes the run's summary. Its manual is `deploy/launch.py --help`. One module per concern:

    programs   what the launcher knows of the two binaries (names, exit statuses, defaults)
    flags      the launcher's command line, its help and its checks
    commands   the binaries' command lines: which flags go to which binary
    hosts      the host file, placement of servers and workers, ports
    remote     the remote shell: the wrapper script, quoting, the preflight
    process    one child process, local or remote, and how it ended
    job        a job's processes and how they start
    supervise  watching a job: failures, grace periods, server restarts, stopping
    slurm      --slurm: the allocation, one srun step per role, requeue and resume
    live       the workers' progress records and the live table
    summary    summary.json and the final report
    main       main(argv), step by step
"""
