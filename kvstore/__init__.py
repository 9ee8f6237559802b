"""k3serve.kvstore: the Mooncake store tier, prefix-cache entries (MLA pages and KDA snapshots)
shared by every worker of the same geometry. docs/kvstore.md is the guide; modules:

* `master`: the `mooncake_master` command line (also rendered into the operator's pod) and a local launcher;
* `client`: `StoreClient`, the one owner of a native client (a closed client is refused, never called);
* `service`: deadlines, the lookup and save lanes, health probing, attach-later;
* `keys`: the key scheme; `lookup`: the longest joint usable hit;
* `connector`: the store tier on the KV connector API, and the router's `store_lookup`;
* `metrics`: its stats as catalog metrics; `netns`: private network namespaces (clients listen on
  every interface).
"""
