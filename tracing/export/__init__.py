"""Where ended spans go.

processor  the bounded batch processor: a queue that never blocks the ending thread,
           one export thread, exact delivery counts, a bounded shutdown
exporters  the exporters by name (OTLP gRPC/HTTP, the OTLP/JSON trace file, console)
process    the export process: OTLP encoding and sending in a child process
child      the child's main loop
wire       the records piped to the child, and the request the child encodes
"""
