// Linked into every executable of the instrumented build (CMakeLists.txt, MOE_SANITIZE) and
// nowhere else. Open MPI loads its components (transports, PMIx, hwloc glue) as plugins and
// unloads them in MPI_Finalize, before LeakSanitizer looks at the heap. Their once-per-process
// allocations then print as "<unknown module>" frames that tests/sanitizers/lsan.supp cannot name.
// Interposing dlclose as a no-op keeps every plugin mapped until exit, so each such allocation's
// top frame is a named Open MPI module and the suppressions match with ASan's fast unwinder:
// the slow one, needed otherwise to reach a named frame through the plugins' frame-pointer-less
// code, made the MPI and command-line tests about three times slower.
// Unloading nothing changes no result: the process exits soon after MPI_Finalize in every test.
extern "C" int dlclose(void* /*handle*/) noexcept { return 0; }
