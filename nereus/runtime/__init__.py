"""The RL runtime: workers (one per GPU slot; a virtual GPU on CPU), the step loop, the controller
on rank 0, metrics and the report. ``nereus run EXP.yaml`` starts it (``launch_local``)."""
