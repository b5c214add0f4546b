"""SHA-256 of the checkpoints shipped with kvsched (:mod:`kvsched.agents.trust` loads them without
``--trust-checkpoint``). Paths relative to the repository; a checkpoint is trusted by content, wherever
it lies. ``tests/agents/test_checkpoint_trust.py`` checks that every shipped checkpoint is listed."""

SHIPPED_SHA256: dict[str, str] = {
    "agents/checkpoints/bench-v1/es-kv-burst-tiers-s0.zip":
        "ce4b1906eb4370d3dcc82ecc9fe722fdd1f15797d05aebd662b2434bfd82e512",
    "agents/checkpoints/bench-v1/es-kv-burst-tiers-s1.zip":
        "1427fcfa51582563f487667f82920e86a391e327fd08bf7ca12cce8f9db16659",
    "agents/checkpoints/bench-v1/es-kv-burst-tiers-s2.zip":
        "ff06fc7705cfdc73ebbd131185677ba2a6e6663c3bd4af2249bf36d632cc2805",
    "agents/checkpoints/bench-v1/es-mooncake-1i-s0.zip":
        "dc6c9a4afed5154fd0ea0e85273f9c0899cd504a86227e5a251ce00287729b70",
    "agents/checkpoints/bench-v1/es-mooncake-1i-s1.zip":
        "ce4397ddd07b3e5b548aaa3fc005d6844814ca150fc79cee2366e2499f719f25",
    "agents/checkpoints/bench-v1/es-mooncake-1i-s2.zip":
        "3a66ee5651062af92888ee5eb7f4b13dae00c3258792b704f99da9d89ddae2de",
    "agents/checkpoints/bench-v1/es-overload-burst-s0.zip":
        "0218b6707d1e7b588c62d60329c8b599b9fba844d2845ca19448394686d495cd",
    "agents/checkpoints/bench-v1/es-overload-burst-s1.zip":
        "ca2753c7877a7b7544c89375ed86bb9fbe9d134fb1da95cda71c3fda5de1d343",
    "agents/checkpoints/bench-v1/es-overload-burst-s2.zip":
        "c6f3f47055196fc407507cdb3456c49e6b0c8d29e5b5d70d7466a6f02f547f5e",
    "agents/checkpoints/bench-v1/es-sessions-small-kv-s0.zip":
        "72126c417238bf1a83bfd88ed432a8e66b2047fd56564059ebd1ab3da0037d2c",
    "agents/checkpoints/bench-v1/es-sessions-small-kv-s1.zip":
        "437fa9585ffac1f754ea04b133bda9a8d425ad82f7df1f76619f7f90001b18b8",
    "agents/checkpoints/bench-v1/es-unpaired-overload-burst-s0.zip":
        "51e72b876f1b7a1fb45141672d081db60e1f474b4932ff11d9fdd553263b9cf4",
    "agents/checkpoints/bench-v1/es-v1-overload-burst-s0.zip":
        "3d393c72c1191a7423538adf1d487ba667447e8a98838b4d90eb6867a2d5474d",
    "agents/checkpoints/scheduling_maskable_ppo.zip":
        "bcecf872199f558e64651f9d7a50afaf9cbf3b871fcc0bdf76e500396fe14acb",
    "experiments/suite/results/v1/kv-burst-tiers/clone.zip":
        "a1b3eaaf97a1527358771d2d6dd3f281ddc241fc415512aaad1e64b682b64b67",
    "experiments/suite/results/v1/mooncake-1i/clone.zip":
        "c36613c59a75e7d5927d915e1ab287137f9e0ee89b57dddaf245bc4eee8f64be",
    "experiments/suite/results/v1/overload-burst/clone.zip":
        "e7a325bbfedd18654a005e358c12a54b646174eeb3d190044a85eb084a0d3b94",
    "experiments/suite/results/v1/residency-sessions/clone.zip":
        "1c2535871ceb0ec7b3637a2e28d93f90624c5d47561b44b0133cab29ee95a7f1",
    "experiments/suite/results/v1/routing-stale/clone.zip":
        "b4f03d48c0b91862cdac79fbe06a42e6bb3266d3a1f3d0151bb70ac0d5e56ba9",
    "experiments/suite/results/v1/sessions-small-kv/clone.zip":
        "9eba5d4b21894b4713d7c76765cd3e0f0c2a6331c981772cb33600e31dd0b3bb",
}
