"""Multi-host serving: one multi-controller JAX program (jax.distributed) over every host's devices.

    serve.py: runtime.initialize (every process joins; process 0 hosts the coordination service) returns
              this process's ProcessGroup, which serve.py hands to the engine build and everything below
      process 0: builds the engine (agreement.py: same config everywhere), serves; its runner is a
                 LeaderRunner (leader_runner.py): each device call is first sent as a plan (plan.py)
      others:    build the same engine, then run_follower (follower.py): read plans in order, run them
      all:       beat through the coordination service; a silent peer, a step that never completes or
                 plans whose digests differ stop every process with an error naming it (ProcessGroup.fatal)

Expert moves and checkpoint saves travel as plans too (experts.py, loading/orbax_checkpoint.py).
Nothing is imported here: config.py stays light for the config files (the router reads them without JAX).
"""
