"""Inside an allocation: who am I (JobEnvironment), where are the others (rendezvous), collectives env."""
