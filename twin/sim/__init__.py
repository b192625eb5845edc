"""The simulated cluster: SimPy processes for instances, the dispatcher in front of them, the fleet that
starts and drains them, and the run that ties them to a workload (`Cluster`, `simulate`)."""
