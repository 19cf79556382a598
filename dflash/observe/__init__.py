"""What a training run tells a person: telemetry set-up, tables, verdict, report.

observer     tracing and metrics from the config, interval tables, the bounded shutdown
instruments  the timeline, NVTX, the torch.profiler window, peak memory, FLOPs figures
flops        model FLOPs of the target forward and the drafter step
bottleneck   the verdict: which stage the others waited for
metrics      the OTel metrics a run exports (one table of names and units)
report       report.html of a run folder (report_svg draws its charts)
"""
