-- hybridpd prefix lookup: ONE round trip for the store hit and every live
-- instance's local hit, under the hybrid rule (see hybridpd/checkpoints.py).
--
-- ARGV[1] key prefix "hpd:<model>:"   ARGV[2] num_tokens   ARGV[3] unit
-- ARGV[4] "1" if EAGLE drops the last block   ARGV[5..] chain hashes (hex)
-- Returns {store_hit, inst_1, hit_1, inst_2, hit_2, ...} (hits in tokens).
--
-- Cost: one MGET/HMGET for the leading run of KV blocks per group, then
-- single probes for state from the top of that run downwards (the deepest
-- checkpoint is usually found in a probe or two).
local prefix = ARGV[1]
local n_tokens = tonumber(ARGV[2])
local unit = tonumber(ARGV[3])
local eagle = ARGV[4] == "1"
local n = #ARGV - 4
local cap = math.min(n, math.floor((n_tokens - 1) / unit))
if cap < 0 then cap = 0 end

local function leading(present)
  local lead = 0
  while lead < cap and present[lead + 1] do lead = lead + 1 end
  if eagle and lead > 0 then lead = lead - 1 end
  return lead
end

local result = {0}
if cap > 0 then
  local kv_keys = {}
  for i = 1, cap do kv_keys[i] = prefix .. "kv:" .. ARGV[4 + i] end
  local lead = leading(redis.call("MGET", unpack(kv_keys)))
  for i = lead, 1, -1 do
    if redis.call("EXISTS", prefix .. "st:" .. ARGV[4 + i]) == 1 then
      result[1] = i * unit
      break
    end
  end
end

local instances = redis.call("SMEMBERS", prefix .. "instances")
table.sort(instances)
for _, inst in ipairs(instances) do
  if redis.call("EXISTS", prefix .. "hb:" .. inst) == 1 then
    local h = 0
    if cap > 0 then
      local lead = leading(redis.call("HMGET", prefix .. "lkv:" .. inst, unpack(ARGV, 5, 4 + cap)))
      local lst = prefix .. "lst:" .. inst
      for i = lead, 1, -1 do
        if redis.call("HEXISTS", lst, ARGV[4 + i]) == 1 then
          h = i * unit
          break
        end
      end
    end
    table.insert(result, inst)
    table.insert(result, h)
  else
    redis.call("SREM", prefix .. "instances", inst)
  end
end
return result
