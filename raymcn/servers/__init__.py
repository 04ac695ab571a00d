"""The lab's servers around a sweep: Ray started again at boot and the newest unfinished sweep
continued (``boot``), a node drained before a planned reboot (``drain``), and which sweeps count
as finished or stopped on purpose (``sweeps``). Used by ``raymcn boot``, ``raymcn drain`` and
``raymcn sweep --stop``; nothing here runs inside a training process."""
