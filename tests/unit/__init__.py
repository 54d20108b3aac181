"""In-process unit tests of the daemon's and the adapter's parts: real objects, no daemon process,
no ZeroMQ; each module runs in about a second. The end-to-end tests (a real daemon, real sockets,
real vLLM engines) are the modules one folder up."""
