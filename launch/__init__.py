"""Login-node launcher (``nereus-launch``) over submitit; it never imports torch.

``site`` (SLURM site templates, time limits) → ``render`` (site + request → submitit parameters
and the sbatch script, pure) → ``submit`` (checks, job folder, submission; grow and shrink) with
``experiment`` (the experiment YAML, node placement, the planner's check) and ``sweep`` (job
arrays); ``jobdir`` is the job folder and its ``job.json``; ``monitor`` follows a job (state,
progress, logs, cancel); ``job`` is what runs on the compute nodes; ``cli`` is the command line.
``inputs`` checks what users hand it: files before they are parsed, and text that reaches an sbatch
script (no control characters), and keeps error lines to one line.
"""
