"""The sandbox: one untrusted program in isolation (namespaces, no capability, a syscall filter,
limits, a wall clock, a cgroup where one can be made), and programs run against tests through
it. A leaf: the tasks that make their tests with it and the rewards that judge with it both
import it; it imports nothing of the package."""
