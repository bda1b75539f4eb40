"""Hook servers built on koordrp.sdk, small enough to read in one sitting."""
